// The fleet page's script: one browser tab becomes one device of an ort-lightning browser fleet.
//
// It opens the fleet's WebSocket (`/join`, with the page's own `token` and optional `name` query
// values), and on the server's `welcome` imports onnxruntime-web's training build from the URL the
// server names, fetches the device files (graphs and checkpoint) as bytes, opens them once with
// runner.js to report its parameter count (`ready`). Each `train` frame (the round's weights and
// each epoch's batches, see ort_lightning/fleet/browser/frames.py) is then trained on a fresh
// device (`openDevice`, `setWeights`, one `train` per epoch, `getWeights`), so that every round
// starts its optimizer anew, as the simulated fleet's devices do; the result frame carries the
// weights, one epoch's example count, the losses and timings. A failure is sent as an `error` frame.
//
// A fleet with a data module (`BrowserFleet(page_data=...)`) names it in the welcome: the page
// imports it, and its train frames carry no batches but `local: {partition, partitions, epochs}`;
// the page then calls the module's `batches({partition, partitions, round, epoch, inputNames})`
// once per local epoch and trains what it returns, so the data never leaves the device.
//
// `hold=N` in the page's query makes it never answer round N: how a hung device looks to the server.

import {openDevice} from './runner.js';

const ARRAYS = {float32: Float32Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array};
const query = new URLSearchParams(location.search);
const hold = Number(query.get('hold') ?? 0);
let ort = null;
let files = null;
let data = null;

function show(status, line) {
  document.getElementById('status').textContent = status;
  if (line) document.getElementById('log').textContent += line + '\n';
}

const padded = (size) => Math.ceil(size / 8) * 8;

/** Header and blobs of a binary frame: uint32 header length, JSON header, padding to 8, payload. */
function unpack(buffer) {
  const length = new DataView(buffer).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, length)));
  const start = padded(4 + length);
  const blobs = header.blobs ?? [[0, buffer.byteLength - start]];
  return {header, blob: (index) => ({start: start + blobs[index][0], bytes: blobs[index][1]})};
}

/** A result frame: the header, then the weights as float32. */
function pack(header, weights) {
  const text = new TextEncoder().encode(JSON.stringify(header));
  const start = padded(4 + text.length);
  const frame = new Uint8Array(start + weights.byteLength);
  new DataView(frame.buffer).setUint32(0, text.length, true);
  frame.set(text, 4);
  frame.set(new Uint8Array(weights.buffer, weights.byteOffset, weights.byteLength), start);
  return frame;
}

function tensor(buffer, frame, {type, dims, blob}) {
  const {start, bytes} = frame.blob(blob);
  const kind = ARRAYS[type];
  return {type, dims, data: new kind(buffer, start, bytes / kind.BYTES_PER_ELEMENT)};
}

async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`GET ${url} answered ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function welcome(socket, message) {
  show(`loading the model as ${message.device}…`);
  ort = await import(message.ort);
  const entries = await Promise.all(Object.entries(message.files).map(async ([role, url]) => [role, await fetchBytes(url)]));
  files = Object.fromEntries(entries);
  if (message.data) data = await importData(message.data);
  const device = await openDevice(ort, files);
  const parameters = device.parameterCount;
  await device.release();
  socket.send(JSON.stringify({type: 'ready', parameters}));
  show(`${message.device}: ready, waiting for a round`, `${message.device}: ${parameters} parameters loaded`);
}

/** The fleet's data module, once it is known to export `batches`. */
async function importData(url) {
  const module = await import(url);
  if (typeof module.batches !== 'function') {
    throw new Error(`the fleet's data module exports [${Object.keys(module).join(', ')}], but a function ` +
      '`batches` was expected; export async function batches({partition, partitions, round, epoch, inputNames}) ' +
      'returning the batches of one epoch (see examples/browser_data.js)');
  }
  return module;
}

/** One epoch's batches: decoded from the frame, or made by the data module for a `local` frame. */
async function epochBatches(header, decoded, index, device) {
  if (!header.local) return decoded[index];
  if (data === null) throw new Error('the server sent a round without batches, but this page has no data module');
  const {partition, partitions} = header.local;
  const batches = await data.batches({partition, partitions, round: header.round, epoch: index,
    inputNames: device.inputNames});
  if (!Array.isArray(batches) || batches.length === 0) {
    throw new Error(`the data module's batches() returned ${Array.isArray(batches) ? 'no batches' : typeof batches} ` +
      `for partition ${partition} of ${partitions}, but a non-empty Array of batches was expected, each an Array ` +
      `of tensors {type, data, dims} for the inputs [${device.inputNames.join(', ')}]`);
  }
  return batches;
}

async function train(socket, buffer) {
  const frame = unpack(buffer);
  const {header} = frame;
  if (header.round === hold) {
    show(`holding round ${header.round} (hold=${hold})`);
    return;
  }
  show(`training round ${header.round}…`);
  const {start, bytes} = frame.blob(header.weights);
  const weights = new Float32Array(buffer, start, bytes / 4);
  const decoded = header.epochs.map((batches) => batches.map((batch) => batch.map((t) => tensor(buffer, frame, t))));
  const epochCount = header.local ? header.local.epochs : decoded.length;
  const opened = performance.now();
  const device = await openDevice(ort, files);
  try {
    await device.setWeights(weights);
    const started = performance.now();
    const losses = [];
    let examples = 0;
    let firstStep = NaN;
    let lastEpochSteps = 0;
    for (let index = 0; index < epochCount; index += 1) {
      const batches = await epochBatches(header, decoded, index, device);
      // NOTE: the first step alone, timed: it carries onnxruntime-web's one-off costs in a new session.
      const parts = index === 0 && batches.length > 1 ? [batches.slice(0, 1), batches.slice(1)] : [batches];
      examples = 0;
      lastEpochSteps = losses.length;
      for (const part of parts) {
        const stepStarted = performance.now();
        const result = await device.train(part);
        if (Number.isNaN(firstStep)) firstStep = (performance.now() - stepStarted) / 1000;
        losses.push(...result.losses);
        examples += result.examples;
      }
      lastEpochSteps = losses.length - lastEpochSteps;
    }
    const seconds = (performance.now() - started) / 1000;
    const trained = await device.getWeights();
    const reply = {type: 'result', id: header.id, examples, steps: losses.length, losses, seconds,
      last_epoch_steps: lastEpochSteps,
      first_step_seconds: firstStep, open_seconds: (started - opened) / 1000};
    socket.send(pack(reply, trained));
    const last = losses[losses.length - 1];
    show(`round ${header.round} done, waiting for the next`,
      `round ${header.round}: ${losses.length} steps in ${seconds.toFixed(3)} s, last loss ${last.toFixed(4)}`);
  } finally {
    await device.release();
  }
}

function main() {
  const url = new URL('join', location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  url.search = location.search;
  const socket = new WebSocket(url);
  socket.binaryType = 'arraybuffer';
  let queue = Promise.resolve();
  socket.onmessage = (event) => {
    // NOTE: one frame at a time, in order: a train frame must wait for the files the welcome fetches.
    queue = queue.then(async () => {
      let id = null;
      try {
        if (typeof event.data === 'string') {
          await welcome(socket, JSON.parse(event.data));
        } else {
          id = unpack(event.data).header.id;
          await train(socket, event.data);
        }
      } catch (error) {
        show(`failed: ${error.message}`, String(error.stack ?? error));
        socket.send(JSON.stringify({type: 'error', id, message: String(error.message ?? error)}));
      }
    });
  };
  socket.onclose = (event) => show(`disconnected (${event.code}${event.reason ? ': ' + event.reason : ''})`);
}

main();
