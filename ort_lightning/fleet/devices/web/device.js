// One device of an ort-lightning browser fleet, whatever runs it: the fleet's page (page.js) or Node.
//
// `FleetDevice` speaks the fleet's protocol (ort_lightning/fleet/devices/frames.py) over one WebSocket:
// on the server's `welcome` it imports onnxruntime-web's training build, reads the device files (graphs and
// checkpoint) as bytes and opens them once with runner.js to report its parameter count (`ready`). Each
// `train` frame (the round's weights and each epoch's batches) is then trained on a fresh device
// (`openDevice`, `setWeights`, one `train` per epoch, `getWeights`), so that every round starts its optimizer
// anew, as the simulated fleet's devices do; the result frame carries the weights, one epoch's example
// count, the losses and timings. A failure is sent as an `error` frame.
//
// Only what trains travels: the welcome's `exchange` says which values a round carries (Exchange in
// ort_lightning/fleet/devices/exchange.py). A LoRA folder's frozen base comes once, in the complete checkpoint,
// which the device keeps across rounds, rejoins and (with a host `fileStore`, a page's Cache Storage) reloads,
// under its digest.
//
// A fleet with a data module (`BrowserFleet(page_data=...)`) names it in the welcome: the device imports
// it, and its train frames carry no batches but `local: {partition, partitions, epochs}`; the device then
// calls the module's `batches({partition, partitions, round, epoch, inputNames})` once per local epoch
// and trains what it returns, so the data never leaves the device.
//
// A fleet that runs Flower's SecAgg+ sends its key stages (setup, share keys, unmask) as `secagg` frames, which
// the device's `SecAggPlusClient` (secagg.js) answers, and its collect stage as a train frame with the stage's
// record (`secagg`) and the legacy parameters' places (`layout`): the device trains, masks its trained values and
// sends them as a `secagg` frame. Its weights never leave it in clear.
//
// What differs between a page and Node comes in as `host`: how to import a module and read bytes by URL,
// where to show the device's status, and runner.js's `openDevice` (a page imports it from the fleet's
// server, Node from the package's files).

import {CLOSE, MESSAGE} from '../../../web/wire.js';
import {decodeRecord, readTrain, recordFrame, resultFrame, unpack} from './frames.js';
import {SecAggPlusClient} from './secagg.js';

/** Seconds since `start` (a performance.now() value). */
const since = (start) => (performance.now() - start) / 1000;

export class FleetDevice {
  /**
   * @param {object} host What the device runs on.
   * @param {function(object): void} host.send Sends a frame (a string or a Uint8Array) to the server.
   * @param {function(string): Promise<object>} host.importModule Imports an ES module by URL.
   * @param {function(string): Promise<Uint8Array>} host.fetchBytes Reads a file of the server by URL.
   * @param {function(object, object): Promise<object>} host.openDevice runner.js's openDevice.
   * @param {function(object): void} [host.show] Receives each change of `status` (for a page's view).
   * @param {{getItem: function(string): ?string, setItem: function(string, string): void}} [host.storage] Where
   *     the device keeps its identity (a page's localStorage); without it, every connection is a new device.
   * @param {{get: function(string): Promise<?Uint8Array>, put: function(string, Uint8Array): Promise<void>}}
   *     [host.fileStore] Where the device keeps the files it downloaded, by digest, across reloads.
   */
  constructor(host) {
    this.host = host;
    /** What a view shows: the device, its phase and progress, what it has done. */
    this.status = {fleet: '', device: '', phase: 'connecting', round: 0, epoch: 0, epochs: 0, step: 0, steps: 0,
      loss: NaN, rounds: 0, parameters: 0, message: '', notice: ''};
    this.ort = null;
    this.files = null;
    this.digests = {};
    this.exchange = null;
    /** Bytes of device files this device downloaded (none for a file it already held). */
    this.downloaded = 0;
    this.data = null;
    /** This round's SecAgg+ client (secagg.js), made at its setup stage. */
    this.secagg = null;
    // NOTE: one frame at a time, in order: a train frame must wait for the files the welcome fetches.
    this.queue = Promise.resolve();
  }

  /**
   * Handles one WebSocket message in arrival order; a failure becomes an error frame.
   *
   * @param {string|ArrayBuffer} data The message.
   * @returns {Promise<void>} Settles once this message is handled.
   */
  receive(data) {
    this.queue = this.queue.then(async () => {
      let id = null;
      try {
        const message = typeof data === 'string' ? JSON.parse(data) : unpack(data).header;
        id = typeof data === 'string' ? null : message.id;
        const handle = HANDLERS[message.type];
        if (handle === undefined) {
          throw new Error(`the server sent a message of type ${JSON.stringify(message.type)}, but a device handles ` +
            `[${Object.keys(HANDLERS).join(', ')}]; the server and the page are of different releases`);
        }
        await handle(this, message, data);
      } catch (error) {
        this.update({phase: 'failed', message: String(error?.message ?? error)});
        this.host.send(JSON.stringify({type: MESSAGE.error, id, message: String(error?.message ?? error)}));
      }
    });
    return this.queue;
  }

  /** The connection closed, with the server's code and reason. */
  closed(code, reason) {
    this.update({phase: code === CLOSE.run_finished ? 'finished' : 'disconnected',
      message: `${code}${reason ? ': ' + reason : ''}`});
  }

  /** Merges `changes` into `status` and shows it. */
  update(changes) {
    Object.assign(this.status, changes);
    this.host.show?.({...this.status});
  }

  /** The server's welcome: load onnxruntime-web, the files and the data module; report `ready`. */
  async welcome(message) {
    this.update({device: message.device, phase: 'loading'});
    this.ort = await this.host.importModule(message.ort);
    await this.loadFiles(message.files, message.digests ?? {});
    this.exchange = message.exchange ?? {mode: 'all'};
    if (message.data) this.data = await importData(this.host, message.data);
    const device = await this.host.openDevice(this.ort, this.files);
    const parameters = sentCount(device, this.exchange);
    await device.release();
    // NOTE: the identity outlives the page: a reloaded page sends it again and the server knows the device.
    const key = `ort-lightning-device:${message.fleet}`;
    let identity = this.host.storage?.getItem(key);
    if (!identity) {
      identity = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, '0')).join('');
      this.host.storage?.setItem(key, identity);
    }
    this.update({fleet: message.fleet, parameters});
    this.host.send(JSON.stringify({type: MESSAGE.ready, parameters, identity}));
  }

  /** The device files by role: those it holds under the same digest kept, the others fetched (and stored). */
  async loadFiles(urls, digests) {
    const entries = await Promise.all(Object.entries(urls).map(async ([role, url]) => {
      const digest = digests[role];
      if (digest !== undefined && this.digests[role] === digest) return [role, this.files[role]];
      const stored = digest === undefined ? undefined : await this.host.fileStore?.get(digest);
      if (stored) return [role, stored];
      const bytes = await this.host.fetchBytes(url);
      this.downloaded += bytes.byteLength;
      if (digest !== undefined) await this.host.fileStore?.put(digest, bytes);
      return [role, bytes];
    }));
    this.files = Object.fromEntries(entries);
    this.digests = {...digests};
  }

  /** The server admitted the device: its name (a device that comes back has its own again) and partition. */
  admitted(message) {
    this.update({phase: 'waiting', device: message.device, partition: message.partition});
  }

  /** One round: train the frame's batches (or the data module's) from its weights; send the result frame. */
  async train(buffer) {
    const {header, weights, epochs: decoded} = readTrain(buffer);
    const epochs = header.local ? header.local.epochs : decoded.length;
    this.update({phase: 'training', round: header.round, epoch: 0, epochs, step: 0, steps: 0});
    const opened = performance.now();
    const device = await this.host.openDevice(this.ort, this.files);
    try {
      await setSent(device, this.exchange, weights);
      const started = performance.now();
      const run = await this.epochs(header, decoded, epochs, device);
      const seconds = since(started);
      const trained = await getSent(device, this.exchange);
      const reply = {type: MESSAGE.result, id: header.id, round: header.round, examples: run.examples, steps: run.losses.length,
        losses: run.losses, seconds, last_epoch_steps: run.lastEpochSteps, first_step_seconds: run.firstStep,
        open_seconds: (started - opened) / 1000};
      if (typeof header.clip === 'number') reply.update_norm = clip(trained, weights, header.clip);
      if (header.secagg) {
        const masked = await this.masked(header, buffer, trained, run.examples);
        this.host.send(recordFrame({...reply, type: MESSAGE.secagg}, masked));
      } else {
        this.host.send(resultFrame(reply, trained));
      }
      this.update({phase: 'sent', rounds: this.status.rounds + 1, loss: run.losses.at(-1)});
    } finally {
      await device.release();
    }
  }

  /** A SecAgg+ key stage (setup, share keys, unmask): the client's answer, as a `secagg` frame. */
  async secureStage(buffer) {
    const frame = unpack(buffer);
    const {header} = frame;
    const pairs = decodeRecord(header.record, frame);
    const record = Object.fromEntries(pairs);
    if (record.stage === 'setup') this.secagg = new SecAggPlusClient({nodeId: BigInt(header.node)});
    if (this.secagg === null) {
      throw new Error(`the server asked for SecAgg+'s ${record.stage} stage, but this device has not set up the ` +
        `round (it joined or reloaded after the setup stage); it sits this round out`);
    }
    const answer = record.stage === 'setup' ? await this.secagg.setup(record)
      : record.stage === 'share_keys' ? await this.secagg.shareKeys(pairs.filter(([key]) => key !== 'stage'))
        : this.secagg.unmask(record);
    this.update({phase: 'securing', stage: record.stage, round: header.round});
    this.host.send(recordFrame({type: MESSAGE.secagg, id: header.id, round: header.round}, answer));
  }

  /** SecAgg+'s collect stage after training: the trained values, per legacy parameter, masked. */
  async masked(header, buffer, trained, examples) {
    if (this.secagg === null) {
      throw new Error("the server asked for SecAgg+'s masked vectors, but this device has not set up the round " +
        '(it joined or reloaded after the setup stage); it sits this round out');
    }
    const record = Object.fromEntries(decodeRecord(header.secagg, unpack(buffer)));
    const arrays = header.layout.map(([start, end, shape]) => ({values: trained.subarray(start, end), shape}));
    return this.secagg.collectMaskedVectors(record, {numExamples: examples, arrays});
  }

  /** The round's local epochs, a batch at a time (so that a view follows the steps). */
  async epochs(header, decoded, count, device) {
    const losses = [];
    let examples = 0;
    let firstStep = NaN;
    let lastEpochSteps = 0;
    let painted = performance.now();
    for (let epoch = 0; epoch < count; epoch += 1) {
      const batches = await epochBatches(this.data, header, decoded, epoch, device);
      examples = 0;
      lastEpochSteps = 0;
      for (const [index, batch] of batches.entries()) {
        const stepStarted = performance.now();
        const result = await device.train([batch]);
        // NOTE: the first step alone, timed: it carries onnxruntime-web's one-off costs in a new session.
        if (Number.isNaN(firstStep)) firstStep = since(stepStarted);
        losses.push(...result.losses);
        examples += result.examples;
        lastEpochSteps += result.steps;
        this.update({epoch: epoch + 1, step: index + 1, steps: batches.length, loss: result.losses.at(-1)});
        // NOTE: onnxruntime-web's steps resolve as microtasks, which never let the page paint; a task break every
        // 50 ms lets a person see the steps (and the tab stay responsive) at a negligible cost.
        if (performance.now() - painted > 50) {
          await new Promise((resolve) => setTimeout(resolve, 0));
          painted = performance.now();
        }
      }
    }
    return {losses, examples, firstStep, lastEpochSteps};
  }
}

/** What a device does with each of the server's messages (wire.json's server messages, each handled once). */
export const HANDLERS = Object.freeze({
  [MESSAGE.welcome]: (device, message) => device.welcome(message),
  [MESSAGE.admitted]: (device, message) => device.admitted(message),
  [MESSAGE.notice]: (device, message) => device.update({notice: message.message}),
  [MESSAGE.train]: (device, header, buffer) => device.train(buffer),
  [MESSAGE.secagg]: (device, header, buffer) => device.secureStage(buffer),
});

/**
 * How many values a round carries for this exchange: all parameters, the trainable ones, or the spans' values.
 *
 * @param {object} device The open runner device.
 * @param {{mode: string, size?: number, spans?: number[][]}} exchange The welcome's exchange.
 * @returns {number} The count the device reports in `ready` (the server refuses another than its own).
 */
export function sentCount(device, exchange) {
  if (exchange.mode === 'trainable') return device.trainableCount;
  if (exchange.mode !== 'spans') return device.parameterCount;
  return exchange.spans.every(([, end]) => end <= device.parameterCount) ? exchange.size : device.parameterCount;
}

/** Loads the round's sent values into the open device (the frozen values stay the checkpoint's). */
async function setSent(device, exchange, sent) {
  if (exchange.mode !== 'spans') return device.setWeights(sent, {trainableOnly: exchange.mode === 'trainable'});
  const whole = await device.getWeights();
  let at = 0;
  for (const [start, end] of exchange.spans) {
    whole.set(sent.subarray(at, at + end - start), start);
    at += end - start;
  }
  return device.setWeights(whole);
}

/** The device's values of the sent tensors, as the result frame carries them. */
async function getSent(device, exchange) {
  if (exchange.mode !== 'spans') return device.getWeights({trainableOnly: exchange.mode === 'trainable'});
  const whole = await device.getWeights();
  const sent = new Float32Array(exchange.size);
  let at = 0;
  for (const [start, end] of exchange.spans) {
    sent.set(whole.subarray(start, end), at);
    at += end - start;
  }
  return sent;
}

/**
 * Flower's client-side fixed clipping, on the device: scales the update (trained - sent) in place so that its L2
 * norm over all values is at most `norm`, as Flower's fixedclipping_mod does for a Python client.
 *
 * @param {Float32Array} trained The trained weights (changed in place).
 * @param {Float32Array} sent The round's weights.
 * @param {number} norm The clipping norm the server's message carries.
 * @returns {number} The update's norm before clipping.
 */
export function clip(trained, sent, norm) {
  let squares = 0;
  for (let i = 0; i < trained.length; i += 1) squares += (trained[i] - sent[i]) ** 2;
  const before = Math.sqrt(squares);
  const scale = Math.min(1, norm / before);
  if (scale < 1) for (let i = 0; i < trained.length; i += 1) trained[i] = sent[i] + (trained[i] - sent[i]) * scale;
  return before;
}

/**
 * The fleet's data module, once it is known to export `batches`.
 *
 * @param {object} host The device's host (its importModule).
 * @param {string} url The module's URL.
 * @returns {Promise<object>} The module.
 */
async function importData(host, url) {
  const module = await host.importModule(url);
  if (typeof module.batches !== 'function') {
    throw new Error(`the fleet's data module exports [${Object.keys(module).join(', ')}], but a function ` +
      '`batches` was expected; export async function batches({partition, partitions, round, epoch, inputNames}) ' +
      'returning the batches of one epoch (see examples/browser_data.js)');
  }
  return module;
}

/**
 * One epoch's batches: decoded from the frame, or made by the data module for a `local` frame.
 *
 * @param {object|null} data The data module, if the fleet has one.
 * @param {object} header The train frame's header.
 * @param {Array<Array<object>>} decoded The frame's epochs.
 * @param {number} epoch The epoch, from 0.
 * @param {object} device The open runner device (its input names).
 * @returns {Promise<Array<Array<object>>>} The batches.
 */
async function epochBatches(data, header, decoded, epoch, device) {
  if (!header.local) return decoded[epoch];
  if (data === null) throw new Error('the server sent a round without batches, but this device has no data module');
  const {partition, partitions} = header.local;
  const batches = await data.batches({partition, partitions, round: header.round, epoch,
    inputNames: device.inputNames});
  if (!Array.isArray(batches) || batches.length === 0) {
    throw new Error(`the data module's batches() returned ${Array.isArray(batches) ? 'no batches' : typeof batches} ` +
      `for partition ${partition} of ${partitions}, but a non-empty Array of batches was expected, each an Array ` +
      `of tensors {type, data, dims} for the inputs [${device.inputNames.join(', ')}]`);
  }
  return batches;
}
