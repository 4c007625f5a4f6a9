// node tests/web/mistakes.mjs job.json MISTAKE: one mistake a caller of the runner can make, on the job's
// device folder and batches (see train_device.mjs); the runner's Error goes uncaught, as a caller would see it.
import { readFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [jobPath, mistake] = process.argv.slice(2);
const job = JSON.parse(await readFile(jobPath, 'utf8'));
const { ARRAYS } = await import(new URL('wire.js', pathToFileURL(job.runner)).href); // beside runner.js
const load = async (file, type) => new ARRAYS[type](new Uint8Array(await readFile(join(dirname(jobPath), file))).buffer);
const batches = await Promise.all(job.batches.map((batch) => Promise.all(
  batch.map(async ({ file, type, dims }) => ({ type, data: await load(file, type), dims })))));
const { dist, runner, folder, format } = job;
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
const { openDevice, trainRound } = await import(pathToFileURL(runner).href);
const read = async (name) => new Uint8Array(await readFile(join(folder, name)));
const files = {
  training: await read(`training_model.${format}`), eval: await read(`eval_model.${format}`),
  optimizer: await read(`optimizer_model.${format}`), checkpoint: await read('nominal_checkpoint'),
};
const opened = async () => {
  const device = await openDevice(ort, files);
  await device.setWeights(await load(job.weights, 'float32'));
  return device;
};

const MISTAKES = {
  'inference-build': async () => openDevice(await import(pathToFileURL(`${dist}/ort.wasm.min.mjs`).href), files),
  'ort-left-out': () => openDevice(files),
  'paths-for-files': () => openDevice(ort, { ...files, eval: join(folder, `eval_model.${format}`) }),
  'zero-epochs': async () => (await opened()).train(batches, { epochs: 0 }),
  'no-batches': async () => trainRound(ort, files, await load(job.weights, 'float32'), []),
  'int64-as-numbers': async () => (await opened()).evaluate(batches.map(([features, labels]) => [
    features, { ...labels, data: Array.from(labels.data, Number) }])),
  'outputs-of-a-loss-only-eval-graph': async () => (await opened()).evaluate(batches, { outputs: true }),
};
await MISTAKES[mistake]();
