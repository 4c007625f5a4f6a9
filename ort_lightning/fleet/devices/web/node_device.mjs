// Fleet devices in Node: each joins a browser fleet over the same WebSocket as a page and trains with runner.js,
// through the same FleetDevice (device.js) as the page, so that tests and users can run many web devices
// without browsers. One process holds any number of devices; they share one onnxruntime-web module.
//
//   node --experimental-websocket node_device.mjs URL --ort-web DIST [--devices N] [--name PREFIX]
//
// (Node 22 and newer have WebSocket without the flag.) In a script:
//
//   const {joinFleet} = await import('.../ort_lightning/fleet/devices/web/node_device.mjs');
//   const device = await joinFleet(url, {ort, name: 'node-1'});   // resolves once the server admitted it
//   ...; device.leave();                                           // closes as a page's leave button does
//   await stayInFleet(url, {ort, name: 'node-2'});                  // joins again after a server restart
//
// A device keeps its identity in `storage` (a Map-like {getItem, setItem}; one per device by default, so that
// joining again with the same storage comes back as the same device).

import {pathToFileURL} from 'node:url';

import {openDevice} from '../../../web/runner.js';
import {FINAL_CLOSES, FleetDevice} from './device.js';

/**
 * A storage in memory, as a page's localStorage.
 *
 * @returns {{getItem: function(string): ?string, setItem: function(string, string): void}} The storage.
 */
export function memoryStorage() {
  const items = new Map();
  return {getItem: (key) => items.get(key) ?? null, setItem: (key, value) => void items.set(key, value)};
}

/**
 * Joins the fleet at `url` (the URL it printed, with its token) as one device.
 *
 * @param {string} url The fleet's URL (http or https, with ?token=...).
 * @param {object} options The device.
 * @param {object} options.ort onnxruntime-web's training build (dist/ort.training.wasm.min.mjs), imported.
 * @param {string} [options.name] The device's name (the server's logs show it).
 * @param {object} [options.storage] Where the device keeps its identity (memoryStorage() by default).
 * @param {function(object): void} [options.show] Receives each change of the device's status.
 * @returns {Promise<{device: FleetDevice, socket: WebSocket, storage: object, closed: Promise<object>,
 *     leave: function(): void}>} Once the server admitted the device (rejects if it refused it).
 */
export function joinFleet(url, {ort, name = '', storage = memoryStorage(), show} = {}) {
  const base = new URL(url);
  const join = new URL('join', base);
  join.protocol = base.protocol === 'https:' ? 'wss:' : 'ws:';
  join.search = base.search;
  if (name) join.searchParams.set('name', name);
  const socket = new WebSocket(join);
  socket.binaryType = 'arraybuffer';
  const fetchBytes = async (path) => {
    const response = await fetch(new URL(path, base));
    if (!response.ok) throw new Error(`GET ${path} answered ${response.status} ${response.statusText}`);
    return new Uint8Array(await response.arrayBuffer());
  };
  // NOTE: the server names its own onnxruntime-web; a Node device uses the one it was given. A data module
  // comes as source and is imported from a data: URL, since Node imports no http: URL.
  const importModule = async (specifier) => {
    if (specifier.endsWith('ort.training.wasm.min.mjs')) return ort;
    const source = new TextDecoder().decode(await fetchBytes(specifier));
    return import(`data:text/javascript;base64,${Buffer.from(source).toString('base64')}`);
  };
  let admitted;
  // NOTE: a device that left may still finish a round; what it would send then goes nowhere, as in a closed tab.
  const send = (frame) => (socket.readyState === WebSocket.OPEN ? socket.send(frame) : undefined);
  const device = new FleetDevice({send, importModule, fetchBytes, openDevice, storage,
    show: (status) => {
      if (status.phase === 'waiting') admitted?.();
      show?.(status);
    }});
  const closed = new Promise((resolve) => {
    const end = (code, reason) => {
      device.closed(code, reason);
      resolve({code, reason});
    };
    socket.onclose = (event) => end(event.code, event.reason);
    // NOTE: Node 20's WebSocket fires only `error`, no `close`, when it cannot connect (a server that is down).
    socket.onerror = () => (socket.readyState === WebSocket.OPEN ? undefined : end(1006, 'the fleet is out of reach'));
  });
  socket.onmessage = (event) => device.receive(event.data);
  return new Promise((resolve, reject) => {
    admitted = () => {
      admitted = null;
      resolve({device, socket, storage, closed, leave: () => socket.close(1000, 'left the fleet')});
    };
    closed.then(({code, reason}) => reject(new Error(`the fleet closed the connection (${code}: ${reason})`)));
  });
}

/**
 * Keeps one device in the fleet at `url` across server restarts: joins, and whenever the connection closes for any
 * reason but leaving (1000), a refusal (1008) or the end of the fleet's run (4000), joins again every `every` ms
 * with the identity it kept, as the fleet's page does, until it is back or `patience` ms have passed without a
 * connection.
 *
 * @param {string} url The fleet's URL (with its token: a server restarted with the same token takes it back).
 * @param {object} options joinFleet's options, and `every` and `patience` (ms).
 * @returns {Promise<?number>} The close code that ended it (1000, 1008 or 4000), or null once patience ran out.
 */
export async function stayInFleet(url, {every = 1000, patience = 60000, ...options} = {}) {
  const storage = options.storage ?? memoryStorage();
  let since = null;
  for (;;) {
    let code;
    try {
      const joined = await joinFleet(url, {...options, storage});
      since = null;
      ({code} = await joined.closed);
    } catch (error) {
      code = /\(1008: /.test(error.message) ? 1008 : null;
    }
    if (FINAL_CLOSES.includes(code)) return code;
    since ??= Date.now();
    if (Date.now() - since > patience) return null;
    await new Promise((resolve) => setTimeout(resolve, every));
  }
}

async function main([url, ...args]) {
  const option = (flag, fallback) => (args.includes(flag) ? args[args.indexOf(flag) + 1] : fallback);
  const dist = option('--ort-web');
  if (!url || !dist) {
    throw new Error('usage: node --experimental-websocket node_device.mjs URL --ort-web DIST [--devices N] ' +
      '[--name PREFIX] (DIST: node_modules/onnxruntime-web/dist of npm install onnxruntime-web@1.19.2)');
  }
  const ort = await import(pathToFileURL(`${dist}/ort.training.wasm.min.mjs`).href);
  const count = Number(option('--devices', '1'));
  const prefix = option('--name', 'node');
  const devices = await Promise.all(Array.from({length: count}, (_, index) => joinFleet(url, {ort,
    name: `${prefix}-${index + 1}`,
    show: (status) => console.log(`${status.device}: ${status.phase}${status.round ? ` round ${status.round}` : ''}`)})));
  await Promise.all(devices.map((device) => device.closed));
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? '').href) await main(process.argv.slice(2));
