// Unit tests of runner.js's own checks (node --test tests/web/): a fake onnxruntime-web namespace that records
// what the runner asks of it. What onnxruntime-web computes is tested end to end against ORT's Python loop
// (tests/web/test_web_runner.py, tests/fleet/engines/browser/test_browser_fleet.py); here, what the runner refuses before or after it.
import assert from 'node:assert/strict';
import { fileURLToPath } from 'node:url';
import { test } from 'node:test';

const { openDevice, trainRound } = await import(
  new URL('../../ort_lightning/web/runner.js', import.meta.url).href);

const PARAMETERS = 4;
const FILES = {
  training: new Uint8Array(1), eval: new Uint8Array(1), optimizer: new Uint8Array(1), checkpoint: new Uint8Array(1),
};

/** A TrainingSession of a 2-input graph (input, labels) over 4 parameters; `fail` makes one call throw. */
function fakeOrt({ fail = {}, createError = null } = {}) {
  const calls = [];
  let parameters = new Float32Array(PARAMETERS);
  const call = async (name, result) => {
    calls.push(name);
    if (name in fail) throw fail[name];
    return result;
  };
  const session = {
    trainingInputNames: ['input', 'labels'], trainingOutputNames: ['loss'],
    evalInputNames: ['input', 'labels'], evalOutputNames: ['loss', 'logits'],
    getParametersSize: async () => PARAMETERS,
    loadParametersBuffer: async (bytes) => {
      parameters = new Float32Array(bytes.slice().buffer);
      return call('loadParametersBuffer');
    },
    runTrainStep: (feed) => call('runTrainStep', { loss: { data: new Float32Array([feed.input.data[0]]) } }),
    runOptimizerStep: () => call('runOptimizerStep'),
    lazyResetGrad: () => call('lazyResetGrad'),
    runEvalStep: (feed) => call('runEvalStep', {
      loss: { data: new Float32Array([feed.input.data[0]]) },
      logits: { type: 'float32', data: new Float32Array(2), dims: [1, 2] },
    }),
    getContiguousParameters: async () => ({ data: parameters }),
    release: () => call('release'),
  };
  const ort = {
    env: { wasm: {} },
    Tensor: class { constructor(type, data, dims) { Object.assign(this, { type, data, dims }); } },
    TrainingSession: {
      create: async () => {
        if (createError) throw createError;
        return session;
      },
    },
  };
  return { ort, calls };
}

const tensor = (type, data, dims) => ({ type, data, dims });
const batch = (value = 1, rows = 2) => [
  tensor('float32', new Float32Array(rows * 3).fill(value), [rows, 3]),
  tensor('int64', new BigInt64Array(rows), [rows]),
];

test('weights of the wrong length or type are refused with the count expected', async (t) => {
  const { ort } = fakeOrt();
  const device = await openDevice(ort, FILES);
  for (const [name, weights, got] of [
    ['too few', new Float32Array(3), 'a Float32Array of 3 values'],
    ['float64', new Float64Array(4), 'a Float64Array of 4 values'],
    ['plain array', [0, 0, 0, 0], 'an Array of 4 items'],
  ]) {
    await t.test(name, () => assert.rejects(device.setWeights(weights), {
      message: new RegExp(`^setWeights expects a Float32Array of 4 values .*but got ${got}; send the weights`),
    }));
  }
  await device.setWeights(new Float32Array([1, 2, 3, 4]));
  assert.deepEqual(Array.from(await device.getWeights()), [1, 2, 3, 4]);
});

test('a batch of another arity is refused before the first step', async () => {
  const { ort, calls } = fakeOrt();
  const device = await openDevice(ort, FILES);
  await assert.rejects(device.train([batch(), [batch()[0]]]), {
    message: 'batch 1 has 1 tensor(s), but the training graph takes 2 inputs [input, labels] (model inputs, then ' +
      'labels); pass one tensor per input, in that order',
  });
  await assert.rejects(device.train([]), { message: /^expected a non-empty Array of batches for the training graph/ });
  await assert.rejects(device.train([batch()], { epochs: 0 }), {
    message: 'train expects epochs to be a positive integer, but got the number 0; pass e.g. {epochs: 1}',
  });
  assert.deepEqual(calls, []);
});

test('labels of another type than their data are refused by batch and input', async (t) => {
  const { ort } = fakeOrt();
  const device = await openDevice(ort, FILES);
  const [features] = batch();
  for (const [name, labels, got] of [
    ['int64 as numbers', tensor('int64', [0, 1], [2]), "type 'int64' with an Array of 2 items"],
    ['int64 as Int32Array', tensor('int64', new Int32Array(2), [2]), "type 'int64' with an Int32Array of 2 values"],
    ['unknown type', tensor('float64', new Float64Array(2), [2]), "type 'float64' with a Float64Array of 2 values"],
  ]) {
    await t.test(name, () => assert.rejects(device.train([[features, labels]]), {
      message: new RegExp(`^batch 0, input 'labels': expected \\{type, data, dims\\} .*but got ${got} as data; ` +
        'int64 labels go in as a BigInt64Array'),
    }));
  }
});

test('a train step that throws a bare number is explained; its own Error passes as it is', async () => {
  const { ort } = fakeOrt({ fail: { runTrainStep: 12345 } });
  const device = await openDevice(ort, FILES);
  await assert.rejects(device.train([batch()]), {
    message: /^batch 0 of the training graph: onnxruntime-web failed without a message \(it threw the number 12345/,
  });
  const own = new Error('input has the wrong shape');
  const { ort: other } = fakeOrt({ fail: { runTrainStep: own } });
  await assert.rejects((await openDevice(other, FILES)).train([batch()]), (error) => error === own);
});

test('optimizer-step and gradient-reset failures say which call and batch, keeping the cause', async (t) => {
  for (const [call, thrown, expected] of [
    ['runOptimizerStep', 77, /^the optimizer step after batch 1: onnxruntime-web failed \(it threw the number 77, a /],
    ['runOptimizerStep', new Error('out of memory'),
      /^the optimizer step after batch 1: onnxruntime-web failed \(out of memory\); check that the optimizer graph/],
    ['lazyResetGrad', new Error('bad state'), /^the gradient reset after batch 1: onnxruntime-web failed \(bad state\)/],
  ]) {
    await t.test(`${call} ${typeof thrown}`, async () => {
      const { ort, calls } = fakeOrt();
      const device = await openDevice(ort, FILES);
      // The call fails on the second batch only: the first batch's update went through.
      let count = 0;
      const original = device.session[call];
      device.session[call] = async () => {
        count += 1;
        if (count === 2) throw thrown;
        return original();
      };
      await assert.rejects(device.train([batch(), batch()]), (error) => {
        assert.match(error.message, expected);
        assert.equal(error.cause, thrown);
        return true;
      });
      assert.equal(calls.filter((name) => name === 'runTrainStep').length, 2);
    });
  }
});

test('train runs one train step, optimizer step and reset per batch and epoch, and counts one epoch', async () => {
  const { ort, calls } = fakeOrt();
  const device = await openDevice(ort, FILES);
  const result = await device.train([batch(0.5, 2), batch(0.25, 3)], { epochs: 2 });
  assert.deepEqual(result, { losses: [0.5, 0.25, 0.5, 0.25], steps: 4, examples: 5 });
  assert.deepEqual(calls, Array(4).fill(['runTrainStep', 'runOptimizerStep', 'lazyResetGrad']).flat());
});

test('evaluate weights each batch loss by its examples', async () => {
  const { ort } = fakeOrt();
  const device = await openDevice(ort, FILES);
  const { loss, examples, outputs } = await device.evaluate([batch(1, 1), batch(4, 3)], { outputs: true });
  assert.equal(examples, 4);
  assert.equal(loss, (1 * 1 + 4 * 3) / 4);
  assert.equal(outputs.length, 2);
});

test('trainRound releases the session when training fails', async () => {
  const { ort, calls } = fakeOrt({ fail: { runOptimizerStep: 5 } });
  await assert.rejects(trainRound(ort, FILES, new Float32Array(PARAMETERS), [batch()]), /optimizer step after batch 0/);
  assert.equal(calls.at(-1), 'release');
});

test('openDevice refuses what is not the training build, and files that are not bytes', async () => {
  await assert.rejects(openDevice(FILES), { message: /^openDevice expects onnxruntime-web's training build as its first/ });
  const { ort } = fakeOrt({ createError: new Error('no available backend found. ERR: backend could not be resolved') });
  await assert.rejects(openDevice(ort, FILES), { message: /namespace it got has no training backend/ });
  const path = fileURLToPath(import.meta.url);
  await assert.rejects(openDevice(fakeOrt().ort, { ...FILES, eval: path }), {
    message: /^openDevice expects the files .* but \[eval\] is missing or not a Uint8Array/,
  });
});
