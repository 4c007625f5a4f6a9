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
import {CLOSE, fetchBytes, joinUrl, stay} from '../../../web/wire.js';
import {FleetDevice} from './device.js';

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
  const socket = new WebSocket(joinUrl(url, name));
  socket.binaryType = 'arraybuffer';
  const fetchFile = (path) => fetchBytes(path, url);
  // NOTE: the server names its own onnxruntime-web; a Node device uses the one it was given. A data module
  // comes as source and is imported from a data: URL, since Node imports no http: URL.
  const importModule = async (specifier) => {
    if (specifier.endsWith('ort.training.wasm.min.mjs')) return ort;
    const source = new TextDecoder().decode(await fetchFile(specifier));
    return import(`data:text/javascript;base64,${Buffer.from(source).toString('base64')}`);
  };
  let admitted;
  // NOTE: a device that left may still finish a round; what it would send then goes nowhere, as in a closed tab.
  const send = (frame) => (socket.readyState === WebSocket.OPEN ? socket.send(frame) : undefined);
  const device = new FleetDevice({send, importModule, fetchBytes: fetchFile, openDevice, storage,
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
      resolve({device, socket, storage, closed, leave: () => socket.close(CLOSE.left, 'left the fleet')});
    };
    closed.then(({code, reason}) => reject(Object.assign(
      new Error(`the fleet closed the connection (${code}: ${reason})`), {code})));
  });
}

/**
 * Keeps one device in the fleet at `url` across server restarts, as the fleet's page does (wire.js's `stay`): joins,
 * and joins again with the identity it kept, every `every` ms, after any close but a final one (leaving, a refusal,
 * the run's end), until `patience` ms have passed without a connection.
 *
 * @param {string} url The fleet's URL (with its token: a server restarted with the same token takes it back).
 * @param {object} options joinFleet's options, and `every` and `patience` (ms).
 * @returns {Promise<?number>} The final close code, or null once patience ran out.
 */
export function stayInFleet(url, {every = 1000, patience = 60000, ...options} = {}) {
  const storage = options.storage ?? memoryStorage();
  const connect = async () => {
    try {
      const joined = await joinFleet(url, {...options, storage});
      return {opened: true, code: (await joined.closed).code};
    } catch (error) {
      return {opened: false, code: error.code ?? null};
    }
  };
  return stay(connect, {every, patience});
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
