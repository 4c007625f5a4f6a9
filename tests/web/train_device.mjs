// node tests/web/train_device.mjs job.json: what tests/test_web_runner.py runs (and the example of docs/browsers.md).
//
// The job names onnxruntime-web's dist/ folder, the runner, a device folder, the graphs' format
// ('ort' or 'onnx'), the epochs, and raw little-endian files: the weights (float32) and each batch's
// tensors. Writes the result beside the job: result.json, trained.bin (float32) and outputs.bin
// (the eval graph's model output of every batch, float32, one after the other).
import { readFile, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

const jobPath = process.argv[2];
const job = JSON.parse(await readFile(jobPath, 'utf8'));
const here = dirname(jobPath);
const { dist, runner, folder, format, epochs } = job;
const { ARRAYS } = await import(new URL('wire.js', pathToFileURL(runner)).href); // beside runner.js
const load = async (file, type) => new ARRAYS[type](new Uint8Array(await readFile(join(here, file))).buffer);
const weights = await load(job.weights, 'float32');
const batches = await Promise.all(job.batches.map((batch) => Promise.all(
  batch.map(async ({ file, type, dims }) => ({ type, data: await load(file, type), dims })))));

// docs/browsers.md, "The device runner": from here to release(), as written there.
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href); // the training build
const { openDevice } = await import(pathToFileURL(runner).href); // ort_lightning/web/runner.js
const read = async (name) => new Uint8Array(await readFile(join(folder, name)));
const device = await openDevice(ort, {
  training: await read(`training_model.${format}`), eval: await read(`eval_model.${format}`),
  optimizer: await read(`optimizer_model.${format}`), checkpoint: await read('nominal_checkpoint'),
});
await device.setWeights(weights); // Float32Array: every parameter, flat, in the training graph's order of its state inputs
const { losses, steps, examples } = await device.train(batches, { epochs }); // one loss per step
const evaluation = await device.evaluate(batches, { outputs: true }); // {loss, examples, outputs}
const trained = await device.getWeights(); // Float32Array, in the same order as the weights sent
await device.release();

const outputs = evaluation.outputs.flatMap((tensor) => Array.from(tensor.data));
await writeFile(join(here, 'trained.bin'), new Uint8Array(trained.buffer));
await writeFile(join(here, 'outputs.bin'), new Uint8Array(new Float32Array(outputs).buffer));
await writeFile(join(here, 'result.json'), JSON.stringify({
  parameterCount: device.parameterCount, losses, steps, examples,
  evaluation: { loss: evaluation.loss, examples: evaluation.examples },
}));
