// node --experimental-websocket tests/web/node_load.mjs URL DIST PLAN: many Node devices (node_device.mjs) join a
// fleet, named d01, d02, ...; PLAN (JSON) says how many, and which of them leave when (`{device, round, phase,
// delay}`: as the device's status first shows `phase` in `round`; at once while `training`, so that it leaves owing
// the round, `delay` ms after it has `sent`), and which of those join again
// (`rejoin`: ms after leaving, with the identity they kept, under the name `<device>-again`). Every binary frame a
// device hands to its open socket is counted by its round. Once the fleet has closed every connection, it prints
// one JSON line: {"sent": [[device, round], ...], "left": [...], "rejoined": [...], "errors": [...]}.
import { pathToFileURL } from 'node:url';

const [url, dist, planText] = process.argv.slice(2);
const plan = JSON.parse(planText);
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
const { joinFleet, memoryStorage } = await import(
  new URL('../../ort_lightning/fleet/devices/web/node_device.mjs', import.meta.url).href);
const { unpack } = await import(new URL('../../ort_lightning/fleet/devices/web/frames.js', import.meta.url).href);

const sent = [];
const left = [];
const rejoined = [];
const errors = [];
// NOTE: every device's socket is Node's WebSocket; its send is where a frame leaves the device.
const send = WebSocket.prototype.send;
WebSocket.prototype.send = function (frame) {
  if (frame instanceof Uint8Array) {
    const name = new URL(this.url).searchParams.get('name').replace(/-again$/, '');
    sent.push([name, unpack(frame.buffer.slice(frame.byteOffset, frame.byteOffset + frame.byteLength)).header.round]);
  }
  return send.call(this, frame);
};

const leaves = new Map(plan.leaves.map((leave) => [leave.device, leave]));
const closings = [];

function watch(name, storage) {
  const leave = leaves.get(name);
  let device = null;
  let triggered = false;
  const show = (status) => {
    if (!leave || triggered || device === null || status.round !== leave.round || status.phase !== leave.phase) return;
    triggered = true;
    const go = (fn) => (status.phase === 'training' ? fn() : setTimeout(fn, leave.delay));
    go(() => {
      device.leave();
      left.push(name);
      if (leave.rejoin !== null) {
        const again = new Promise((resolve) => setTimeout(resolve, leave.rejoin))
          .then(() => joinFleet(url, { ort, name: `${name}-again`, storage }))
          .then((back) => { rejoined.push(name); return back.closed; })
          .catch((error) => errors.push(`${name} could not join again: ${error.message}`));
        closings.push(again);
      }
    });
  };
  return joinFleet(url, { ort, name, storage, show }).then((joined) => { device = joined; return joined; });
}

const names = Array.from({ length: plan.devices }, (_, i) => `d${String(i + 1).padStart(2, '0')}`);
const devices = [];
for (const name of names) devices.push(await watch(name, memoryStorage()));
await Promise.all(devices.map((device) => device.closed));
// NOTE: a rejoin may still be under way when the fleet closes; it ends (closed or refused) soon after.
for (let settled = 0; settled < closings.length;) {
  settled = closings.length;
  await Promise.all(closings);
}
console.log(JSON.stringify({ sent, left, rejoined, errors }));
