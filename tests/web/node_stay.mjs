// node --experimental-websocket tests/web/node_stay.mjs URL DIST: two Node devices, a and b, stay in the fleet
// (node_device.mjs's stayInFleet): when the server goes away they join again every 200 ms, for up to 5 s, with the
// identities they kept. Exits once both were told the run finished (4000), gave up or left; prints their end codes.
import { pathToFileURL } from 'node:url';

const [url, dist] = process.argv.slice(2);
const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
const { stayInFleet } = await import(new URL('../../ort_lightning/fleet/devices/web/node_device.mjs', import.meta.url).href);

const ends = await Promise.all(['a', 'b'].map((name) => stayInFleet(url, { ort, name, every: 200, patience: 5000 })));
console.log(JSON.stringify(ends));
