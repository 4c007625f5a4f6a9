// node --experimental-websocket tests/web/node_fleet.mjs URL DIST: two Node devices (node_device.mjs) join the
// fleet; b leaves as round 2 reaches it (so it owes that round) and joins again 0.5 s later with the identity it
// kept, under another name (the server gives it back its own). Exits once the fleet closes every connection.
import { pathToFileURL } from 'node:url';

const [url, dist] = process.argv.slice(2);
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
const { joinFleet, memoryStorage } = await import(
  new URL('../../ort_lightning/fleet/devices/web/node_device.mjs', import.meta.url).href);

const a = await joinFleet(url, { ort, name: 'a' });
const storage = memoryStorage();
let b = null;
let again = null;
b = await joinFleet(url, { ort, name: 'b', storage, show: (status) => {
  if (b !== null && again === null && status.phase === 'training' && status.round === 2) {
    b.leave();
    again = new Promise((resolve) => setTimeout(resolve, 500)).then(() => joinFleet(url, { ort, name: 'b-again', storage }));
  }
} });
await a.closed;
await (await again)?.closed;
