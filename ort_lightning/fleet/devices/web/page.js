// The fleet page's script: this tab becomes one device of an ort-lightning browser fleet.
//
// It opens the fleet's WebSocket (`/join`, with the page's own `token` and optional `name` query values)
// and hands every message to a `FleetDevice` (device.js: the protocol, shared with Node devices), which
// trains the rounds with runner.js; this script only shows the device's status.

import {openDevice} from '../../../web/runner.js';
import {CLOSE, fetchBytes, joinUrl, stay} from '../../../web/wire.js';
import {FleetDevice} from './device.js';

/**
 * One line of the device's status, for the page.
 *
 * @param {object} status FleetDevice's status.
 * @returns {string} e.g. "round 2, epoch 1/2, step 3/30, loss 0.4321".
 */
function describe(status) {
  const loss = Number.isFinite(status.loss) ? `, loss ${status.loss.toFixed(4)}` : '';
  switch (status.phase) {
    case 'training':
      return `round ${status.round}, epoch ${status.epoch}/${status.epochs}, step ${status.step}/${status.steps}${loss}`;
    case 'sent':
      return `round ${status.round} sent${loss}; waiting for the next round`;
    case 'securing':
      return `round ${status.round}: secure aggregation, ${status.stage.replaceAll('_', ' ')} stage`;
    case 'waiting':
      return `ready (${status.parameters} parameters); waiting for a round`;
    case 'disconnected':
      // NOTE: the leave button's normal closure; any other code is the server's or the network's.
      return status.message.startsWith(String(CLOSE.left)) ? 'left this fleet; reload the page to join again as this device'
        : `${status.phase}: ${status.message}`;
    case 'finished':
      return `the fleet's run finished; this device took part in ${status.rounds} round(s)`;
    case 'failed':
      return `${status.phase}: ${status.message}`;
    default:
      return status.phase;
  }
}

function show(status) {
  document.getElementById('fleet').textContent = status.fleet || 'ort-lightning fleet';
  document.getElementById('status').textContent = `${status.device ? status.device + ': ' : ''}${describe(status)}`;
  document.getElementById('rounds').textContent = `rounds taken part in: ${status.rounds}`;
  document.getElementById('notice').textContent = status.notice ? `the fleet says: ${status.notice}` : '';
  document.getElementById('leave').disabled = status.phase === 'disconnected' || status.phase === 'finished';
}

/** Seconds between two tries to reach a fleet that went away, and how long to keep trying. */
const RETRY_SECONDS = 3;
const PATIENCE_SECONDS = 600;

/**
 * One connection of `device` to the fleet (the page's own URL, with its token and name), until it closes.
 *
 * @returns {Promise<{opened: boolean, code: number}>} Whether it opened, and its close code.
 */
function connect(device, link) {
  return new Promise((resolve) => {
    const socket = new WebSocket(joinUrl(location.href));
    socket.binaryType = 'arraybuffer';
    link.socket = socket;
    let opened = false;
    socket.onopen = () => { opened = true; };
    socket.onmessage = (event) => device.receive(event.data);
    socket.onclose = (event) => {
      device.closed(event.code, event.reason);
      resolve({opened, code: event.code});
    };
  });
}

/** Where a page keeps the device files it downloaded, by digest (Cache Storage; absent outside a secure context). */
const FILES_CACHE = 'ort-lightning-device-files';
const fileStore = typeof caches === 'undefined' ? undefined : {
  async get(digest) {
    const hit = await (await caches.open(FILES_CACHE)).match(`/ort-lightning-files/${digest}`);
    return hit ? new Uint8Array(await hit.arrayBuffer()) : undefined;
  },
  async put(digest, bytes) {
    // NOTE: a page without room keeps the files for this visit only: the next visit downloads them again.
    try {
      await (await caches.open(FILES_CACHE)).put(`/ort-lightning-files/${digest}`, new Response(bytes));
    } catch (error) {
      console.warn(`the device files could not be kept for the next visit (${error?.message ?? error})`);
    }
  },
};

function main() {
  const link = {socket: null};
  const device = new FleetDevice({
    send: (frame) => link.socket.send(frame), importModule: (specifier) => import(specifier),
    fetchBytes: (url) => fetchBytes(url, location.href), openDevice, show, storage: localStorage, fileStore,
  });
  // NOTE: a normal closure: the server logs the device as one that left, not one that failed.
  document.getElementById('leave').onclick = () => link.socket.close(CLOSE.left, 'left the fleet');
  // NOTE: a server restarted with the same token takes the device back (its identity is in localStorage).
  stay(() => connect(device, link), {every: RETRY_SECONDS * 1000, patience: PATIENCE_SECONDS * 1000,
    retrying: (code) => device.update({message: `${code}: the fleet is out of reach; trying again every ` +
      `${RETRY_SECONDS} s`})});
}

main();
