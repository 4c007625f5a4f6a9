// node benchmarks/web_node.mjs job.json: the device runner's timings in Node, for python -m benchmarks.web.
//
// Times, in milliseconds: importing onnxruntime-web's training build; the first step (openDevice, which
// creates the training session and, the first time in a process, compiles the WebAssembly; setWeights; one
// training step); then `steps` more steps in one train() call, per step, by the wall clock and by the
// process's CPU time. Prints one JSON line.
import { readFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { pathToFileURL } from 'node:url';

const ARRAYS = { float32: Float32Array, int64: BigInt64Array };
const jobPath = process.argv[2];
const job = JSON.parse(await readFile(jobPath, 'utf8'));
const load = async (file, type) => new ARRAYS[type](new Uint8Array(await readFile(join(dirname(jobPath), file))).buffer);
const batches = await Promise.all(job.batches.map((batch) => Promise.all(
  batch.map(async ({ file, type, dims }) => ({ type, data: await load(file, type), dims })))));
const weights = await load(job.weights, 'float32');
const read = async (name) => new Uint8Array(await readFile(join(job.folder, name)));
const files = {
  training: await read(`training_model.${job.format}`), eval: await read(`eval_model.${job.format}`),
  optimizer: await read(`optimizer_model.${job.format}`), checkpoint: await read('nominal_checkpoint'),
};

let start = performance.now();
const ort = await import(pathToFileURL(`${job.dist}/ort.training.wasm.min.mjs`).href);
const { openDevice } = await import(pathToFileURL(job.runner).href);
const importMs = performance.now() - start;

start = performance.now();
const device = await openDevice(ort, files);
await device.setWeights(weights);
await device.train(batches.slice(0, 1));
const firstStepMs = performance.now() - start;

const epochs = Math.ceil(job.steps / batches.length);
start = performance.now();
const cpu = process.cpuUsage();
const { steps } = await device.train(batches, { epochs });
const stepMs = (performance.now() - start) / steps;
const used = process.cpuUsage(cpu);
const stepCpuMs = (used.user + used.system) / 1000 / steps;
await device.release();
console.log(JSON.stringify({ importMs, firstStepMs, stepMs, stepCpuMs, steps }));
