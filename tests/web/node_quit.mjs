// node --experimental-websocket tests/web/node_quit.mjs URL DIST NAME STAGE ROUND: one Node device (node_device.mjs's
// joinFleet) named NAME joins the fleet and kills its own process (SIGKILL: no close frame, no goodbye) as soon as
// the server's frame for SecAgg+ stage STAGE (setup, share_keys, collect_masked_vectors, unmask) of round ROUND
// arrives, before the device sees it. Each frame is read before the device gets it: a `secagg` frame's record
// names its stage; the collect stage is a `train` frame whose header carries the stage's record (`secagg`).
import { writeSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

const [url, dist, name, stage, round] = process.argv.slice(2);
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
const web = new URL('../../ort_lightning/fleet/devices/web/', import.meta.url);
const { joinFleet } = await import(new URL('node_device.mjs', web).href);
const { unpack } = await import(new URL('frames.js', web).href);

/** The SecAgg+ stage a server frame asks for, or null for any other frame. */
function stageOf(data) {
  if (!(data instanceof ArrayBuffer)) return null;
  const { header } = unpack(data);
  if (header.type === 'train') return header.secagg ? 'collect_masked_vectors' : null;
  if (header.type !== 'secagg') return null;
  return header.record.find(([key]) => key === 'stage')?.[1] ?? null;
}

const device = await joinFleet(url, { ort, name });
const deliver = device.socket.onmessage;
device.socket.onmessage = (event) => {
  if (stageOf(event.data) === stage && unpack(event.data).header.round === Number(round)) {
    writeSync(2, `${name}: killed at ${stage} of round ${round}\n`);
    process.kill(process.pid, 'SIGKILL');
  }
  deliver(event);
};
await device.closed;
