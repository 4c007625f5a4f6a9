// The device runner: trains ort-lightning's device artifacts in onnxruntime-web's training build.
//
// No dependencies and no bundler: the caller passes onnxruntime-web's namespace `ort` (the
// training build, `dist/ort.training.wasm.min.mjs` of onnxruntime-web 1.19.2) and the files as
// bytes, so the same module runs in Node (files read from disk) and in a page (files fetched).
//
//   const device = await openDevice(ort, {training, eval, optimizer, checkpoint});
//   await device.setWeights(weights);              // Float32Array, all parameters, flat
//   await device.setWeights(adapters, {trainableOnly: true});   // or the trainable ones alone (LoRA)
//   const {losses, examples} = await device.train(batches, {epochs: 2});
//   const {loss} = await device.evaluate(batches);
//   const trained = await device.getWeights();
//   await device.release();
//
// What onnxruntime-web cannot do, and what this module therefore never tries: set the learning
// rate (its optimizer runs at the rate the optimizer graph computes, ORT's default 1e-3 unless
// the folder was prepared for the web) and save a checkpoint (only the weights come back, so a
// device's optimizer state starts fresh each round).

import {ARRAYS} from './wire.js';

/** The files a device needs, under the names `openDevice` takes, and what each one is. */
const FILES = {
  training: 'the training graph (training_model.ort or .onnx)',
  eval: 'the eval graph (eval_model.ort or .onnx)',
  optimizer: 'the optimizer graph (optimizer_model.ort or .onnx)',
  checkpoint: 'the checkpoint (nominal_checkpoint, or the complete checkpoint)',
};

/**
 * Opens a training session on a device folder's files.
 *
 * @param {object} ort onnxruntime-web's namespace, from its training build.
 * @param {{training: Uint8Array, eval: Uint8Array, optimizer: Uint8Array, checkpoint: Uint8Array}} files
 *     The graphs and the checkpoint as bytes (onnxruntime-web loads paths with fetch(), which Node lacks).
 * @returns {Promise<Device>} The device; call `release()` when done.
 */
export async function openDevice(ort, files) {
  if (!ort || typeof ort.TrainingSession?.create !== 'function') {
    throw new Error('openDevice expects onnxruntime-web\'s training build as its first argument (a namespace ' +
      'with TrainingSession), but got ' + describe(ort) + '; import dist/ort.training.wasm.min.mjs of ' +
      'onnxruntime-web 1.19.2 (npm install onnxruntime-web@1.19.2) and pass that module');
  }
  checkFiles(files);
  // NOTE: left unset, onnxruntime-web picks a thread count by asking `node:os` for the cores, which
  // its ES module build cannot import in Node; a page without cross-origin isolation gets one thread
  // anyway. One thread also keeps a device's results independent of the machine it runs on.
  if (typeof ort.env?.wasm?.numThreads !== 'number') ort.env.wasm.numThreads = 1;
  let session;
  try {
    session = await ort.TrainingSession.create({
      checkpointState: files.checkpoint, trainModel: files.training,
      evalModel: files.eval, optimizerModel: files.optimizer,
    });
  } catch (error) {
    // NOTE: onnxruntime-web's other builds export TrainingSession too; only creating one tells them apart.
    if (!/backend could not be resolved/.test(String(error?.message))) throw error;
    throw new Error(`openDevice expects onnxruntime-web's training build, but the namespace it got has no ` +
      `training backend (TrainingSession.create: ${error.message}); import dist/ort.training.wasm.min.mjs, not ` +
      'ort.min.mjs or ort.wasm.min.mjs, of onnxruntime-web 1.19.2 and pass that module', {cause: error});
  }
  return new Device(ort, session, await session.getParametersSize(false), await session.getParametersSize(true));
}

/**
 * One round of a device: open, set the weights, train, read the weights back, release.
 *
 * @param {object} ort onnxruntime-web's namespace, from its training build.
 * @param {object} files The graphs and the checkpoint as bytes (see `openDevice`).
 * @param {Float32Array} weights All parameters, flat, in ONNX Runtime's buffer order (see `setWeights`).
 * @param {Array<Array<object>>} batches The batches (see `Device.train`).
 * @param {{epochs?: number}} [options] Passes over the batches.
 * @returns {Promise<{weights: Float32Array, examples: number, losses: number[], steps: number}>}
 */
export async function trainRound(ort, files, weights, batches, {epochs = 1} = {}) {
  const device = await openDevice(ort, files);
  try {
    await device.setWeights(weights);
    const {losses, steps, examples} = await device.train(batches, {epochs});
    return {weights: await device.getWeights(), examples, losses, steps};
  } finally {
    await device.release();
  }
}

/** A training session on one device folder, with the runner's checks in front of onnxruntime-web. */
export class Device {
  /**
   * @param {object} ort onnxruntime-web's namespace.
   * @param {object} session Its TrainingSession.
   * @param {number} parameterCount Float32 values of all parameters.
   * @param {number} [trainableCount] Float32 values of the trainable parameters.
   */
  constructor(ort, session, parameterCount, trainableCount = parameterCount) {
    this.ort = ort;
    this.session = session;
    /** Number of float32 values of all parameters (trainable and frozen). */
    this.parameterCount = parameterCount;
    /** Number of float32 values of the trainable parameters (a LoRA model's adapters). */
    this.trainableCount = trainableCount;
  }

  /** The training graph's input names, in the order a batch holds its tensors (model inputs, then labels). */
  get inputNames() {
    return [...this.session.trainingInputNames];
  }

  /**
   * Replaces every parameter's value, or every trainable one's.
   *
   * @param {Float32Array} weights All parameters, flat, in the order of ONNX Runtime's parameter buffer:
   *     the training graph's order of its state inputs (not the manifest's parameter_order, which
   *     lists a model's buffers, such as BatchNorm's running statistics, after all its parameters).
   * @param {{trainableOnly?: boolean}} [options] `trainableOnly`: the trainable parameters alone, in that
   *     order; the frozen ones keep the checkpoint's values (a complete checkpoint: a nominal one refuses it).
   */
  async setWeights(weights, {trainableOnly = false} = {}) {
    const count = trainableOnly ? this.trainableCount : this.parameterCount;
    if (!(weights instanceof Float32Array) || weights.length !== count) {
      throw new Error(`setWeights expects a Float32Array of ${count} values (all ${trainableOnly ? 'trainable ' : ''}` +
        `parameters, flat, in the training graph's order of its state inputs), but got ${describe(weights)}; send ` +
        'the weights of the artifacts this device opened');
    }
    const bytes = new Uint8Array(weights.buffer, weights.byteOffset, weights.byteLength);
    await this.session.loadParametersBuffer(bytes, trainableOnly);
  }

  /**
   * Trains: per batch, one train step, one optimizer step and a gradient reset.
   *
   * @param {Array<Array<{type: string, data: ArrayLike, dims: number[]}>>} batches A batch is one tensor per
   *     training graph input, in its order (model inputs, then labels); int64 data is a BigInt64Array.
   * @param {{epochs?: number}} [options] Passes over the batches.
   * @returns {Promise<{losses: number[], steps: number, examples: number}>} One loss per step; examples
   *     counts one epoch (the sum of each batch's first dimension).
   */
  async train(batches, {epochs = 1} = {}) {
    if (!Number.isInteger(epochs) || epochs < 1) {
      throw new Error(`train expects epochs to be a positive integer, but got ${describe(epochs)}; pass e.g. ` +
        '{epochs: 1}');
    }
    const names = this.session.trainingInputNames;
    const feeds = toFeeds(this.ort, batches, names, 'training');
    const loss = this.session.trainingOutputNames[0];
    const losses = [];
    for (let epoch = 0; epoch < epochs; epoch += 1) {
      for (const [index, feed] of feeds.entries()) {
        let outputs;
        try {
          outputs = await this.session.runTrainStep(feed);
        } catch (error) {
          throw explained(error, `batch ${index} of the training graph`, names);
        }
        await updated(() => this.session.runOptimizerStep(), `the optimizer step after batch ${index}`);
        await updated(() => this.session.lazyResetGrad(), `the gradient reset after batch ${index}`);
        losses.push(Number(outputs[loss].data[0]));
      }
    }
    return {losses, steps: losses.length, examples: countExamples(batches)};
  }

  /**
   * Evaluates with the eval graph.
   *
   * @param {Array<Array<object>>} batches As for `train`, one tensor per eval graph input.
   * @param {{outputs?: boolean}} [options] `outputs: true` also returns, per batch, the eval graph's
   *     output after the loss (the model's first output, e.g. the logits) as {type, data, dims}.
   * @returns {Promise<{loss: number, examples: number, outputs?: Array<object>}>} The eval loss's
   *     mean over the batches, each weighted by its example count.
   */
  async evaluate(batches, {outputs = false} = {}) {
    const names = this.session.evalInputNames;
    const feeds = toFeeds(this.ort, batches, names, 'eval');
    const [loss, model] = this.session.evalOutputNames;
    if (outputs && model === undefined) {
      throw new Error(`evaluate({outputs: true}) needs an eval graph output besides the loss, but it has only ` +
        `[${loss}]; export the artifacts with the model's outputs kept, or pass {outputs: false}`);
    }
    let total = 0;
    let examples = 0;
    const kept = [];
    for (const [index, feed] of feeds.entries()) {
      let result;
      try {
        result = await this.session.runEvalStep(feed);
      } catch (error) {
        throw explained(error, `batch ${index} of the eval graph`, names);
      }
      const count = batches[index][0].dims[0];
      total += Number(result[loss].data[0]) * count;
      examples += count;
      if (outputs) kept.push({type: result[model].type, data: result[model].data, dims: result[model].dims});
    }
    return outputs ? {loss: total / examples, examples, outputs: kept} : {loss: total / examples, examples};
  }

  /**
   * Reads every parameter's value, or every trainable one's.
   *
   * @param {{trainableOnly?: boolean}} [options] `trainableOnly`: the trainable parameters alone.
   * @returns {Promise<Float32Array>} The parameters, flat, in the order `setWeights` takes; a copy.
   */
  async getWeights({trainableOnly = false} = {}) {
    const parameters = await this.session.getContiguousParameters(trainableOnly);
    return new Float32Array(parameters.data);
  }

  /** Frees the session's WebAssembly memory; the device cannot be used afterwards. */
  async release() {
    await this.session.release();
  }
}

/**
 * Checks the files before onnxruntime-web reads them (its own message names no file).
 *
 * @param {object} files What `openDevice` was given.
 */
function checkFiles(files) {
  const wrong = Object.keys(FILES).filter((name) => !(files?.[name] instanceof Uint8Array));
  if (wrong.length > 0) {
    const expected = Object.entries(FILES).map(([name, what]) => `${name}: ${what}`).join(', ');
    throw new Error(`openDevice expects the files {${expected}} as Uint8Array each, but ` +
      `[${wrong.join(', ')}] ${wrong.length === 1 ? 'is' : 'are'} missing or not a Uint8Array; read each file ` +
      'into a Uint8Array (Node: new Uint8Array(await readFile(path)); a page: new Uint8Array(await ' +
      '(await fetch(url)).arrayBuffer()))');
  }
}

/**
 * Turns batches into onnxruntime-web feeds, one per batch, checking each batch's tensors first.
 *
 * @param {object} ort onnxruntime-web's namespace.
 * @param {Array<Array<object>>} batches The batches.
 * @param {readonly string[]} names The graph's input names, in order.
 * @param {string} graph 'training' or 'eval', for the messages.
 * @returns {Array<Object<string, object>>} One feed per batch.
 */
function toFeeds(ort, batches, names, graph) {
  if (!Array.isArray(batches) || batches.length === 0) {
    throw new Error(`expected a non-empty Array of batches for the ${graph} graph, but got ` +
      `${describe(batches)}; pass [[${names.join(', ')}], ...]`);
  }
  return batches.map((batch, index) => {
    if (!Array.isArray(batch) || batch.length !== names.length) {
      throw new Error(`batch ${index} has ${Array.isArray(batch) ? batch.length + ' tensor(s)' : describe(batch)}, ` +
        `but the ${graph} graph takes ${names.length} inputs [${names.join(', ')}] (model inputs, then labels); ` +
        'pass one tensor per input, in that order');
    }
    return Object.fromEntries(batch.map((tensor, position) => [
      names[position], toTensor(ort, tensor, `batch ${index}, input '${names[position]}'`),
    ]));
  });
}

/**
 * One tensor of a batch as an onnxruntime-web Tensor.
 *
 * @param {object} ort onnxruntime-web's namespace.
 * @param {{type: string, data: ArrayLike, dims: number[]}} tensor The tensor.
 * @param {string} where Which batch and input, for the messages.
 * @returns {object} The ort.Tensor.
 */
function toTensor(ort, tensor, where) {
  const array = ARRAYS[tensor?.type];
  if (array === undefined || !(tensor.data instanceof array)) {
    const accepted = Object.entries(ARRAYS).map(([type, kind]) => `${type}: ${kind.name}`).join(', ');
    throw new Error(`${where}: expected {type, data, dims} with type and data among {${accepted}}, but got ` +
      `type ${describe(tensor?.type)} with ${describe(tensor?.data)} as data; int64 labels go in as a BigInt64Array ` +
      '(BigInt64Array.from(values, BigInt))');
  }
  return new ort.Tensor(tensor.type, tensor.data, tensor.dims);
}

/**
 * An Error for what a step threw: onnxruntime-web's own Error as it is, a bare WebAssembly exception explained.
 *
 * @param {*} error What the step threw.
 * @param {string} where Which batch of which graph.
 * @param {readonly string[]} names The graph's input names, in order.
 * @returns {Error} The error to throw.
 */
function explained(error, where, names) {
  if (error instanceof Error) return error;
  // NOTE: onnxruntime-web 1.19.2 throws a bare number (a WebAssembly exception's address) when a
  // tensor's type or shape does not fit the graph; it carries no message at all.
  return new Error(`${where}: onnxruntime-web failed without a message (it threw ${describe(error)}, a ` +
    'WebAssembly exception), which it does for a tensor whose type or shape the graph does not take; check ' +
    `each tensor's type and dims against the inputs [${names.join(', ')}] (the artifacts' ort_lightning.json ` +
    "lists their dtypes and shapes; int64 labels go in as {type: 'int64', data: BigInt64Array})");
}

/**
 * Runs an optimizer step or a gradient reset, saying which one failed and after which batch.
 *
 * @param {function(): Promise<*>} call The session's call.
 * @param {string} where Which call after which batch, for the message.
 * @returns {Promise<*>} What the call returned.
 */
async function updated(call, where) {
  try {
    return await call();
  } catch (error) {
    // NOTE: neither call takes a tensor of the caller's: what fails here is the optimizer graph against the
    // training graph's parameters (another export's optimizer_model), or memory.
    const cause = error instanceof Error ? error.message : `it threw ${describe(error)}, a WebAssembly exception`;
    throw new Error(`${where}: onnxruntime-web failed (${cause}); check that the optimizer graph comes from the ` +
      'same export as the training graph and the checkpoint (one device folder), and that the device has ' +
      'memory left', {cause: error});
  }
}

/**
 * The number of examples of one pass: the sum of each batch's first dimension.
 *
 * @param {Array<Array<object>>} batches The batches.
 * @returns {number} The count.
 */
function countExamples(batches) {
  return batches.reduce((sum, batch) => sum + batch[0].dims[0], 0);
}

/**
 * A short description of a value for an error message.
 *
 * @param {*} value Anything.
 * @returns {string} e.g. "a Float32Array of 12 values", "'int64'", "undefined", "the number 0".
 */
function describe(value) {
  const article = (name) => (/^[AEIOU]/.test(name) ? 'an' : 'a');
  if (ArrayBuffer.isView(value)) {
    const name = value.constructor.name;
    return `${article(name)} ${name} of ${value.length} values`;
  }
  if (Array.isArray(value)) return `an Array of ${value.length} items`;
  if (typeof value === 'string') return `'${value}'`;
  if (typeof value === 'object' && value !== null) {
    const name = value.constructor?.name ?? 'Object';
    return `${article(name)} ${name}`;
  }
  return value === null || value === undefined ? String(value) : `the ${typeof value} ${String(value)}`;
}
