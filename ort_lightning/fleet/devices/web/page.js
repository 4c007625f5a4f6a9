// The fleet page's script: this tab becomes one device of an ort-lightning browser fleet.
//
// It opens the fleet's WebSocket (`/join`, with the page's own `token` and optional `name` query values)
// and hands every message to a `FleetDevice` (device.js: the protocol, shared with Node devices), which
// trains the rounds with runner.js; this script only shows the device's status.

import {FINAL_CLOSES, FleetDevice} from './device.js';
import {openDevice} from './runner.js';

/**
 * Reads a file of the fleet's server.
 *
 * @param {string} url Its URL.
 * @returns {Promise<Uint8Array>} Its bytes.
 */
async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`GET ${url} answered ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

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
    case 'waiting':
      return `ready (${status.parameters} parameters); waiting for a round`;
    case 'disconnected':
      // NOTE: 1000 is the leave button's normal closure; any other code is the server's or the network's.
      return status.message.startsWith('1000') ? 'left this fleet; reload the page to join again as this device'
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
 * Opens the fleet's WebSocket for `device`. When it closes for any reason but leaving (1000), a refusal (1008) or
 * the end of the fleet's run (4000), as when the server restarts, it tries again every RETRY_SECONDS for up to
 * PATIENCE_SECONDS: a server restarted with the same token takes the device back (its identity is in localStorage).
 */
function connect(device, link, since = null) {
  const url = new URL('join', location.href);
  url.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
  url.search = location.search;
  const socket = new WebSocket(url);
  socket.binaryType = 'arraybuffer';
  link.socket = socket;
  socket.onopen = () => { since = null; };
  socket.onmessage = (event) => device.receive(event.data);
  socket.onclose = (event) => {
    device.closed(event.code, event.reason);
    const start = since ?? performance.now();
    if (FINAL_CLOSES.includes(event.code) || performance.now() - start > PATIENCE_SECONDS * 1000) return;
    device.update({message: `${event.code}: the fleet is out of reach; trying again every ${RETRY_SECONDS} s`});
    setTimeout(() => connect(device, link, start), RETRY_SECONDS * 1000);
  };
}

function main() {
  const link = {socket: null};
  const device = new FleetDevice({
    send: (frame) => link.socket.send(frame), importModule: (specifier) => import(specifier), fetchBytes, openDevice,
    show, storage: localStorage,
  });
  // NOTE: 1000, a normal closure: the server logs the device as one that left, not one that failed.
  document.getElementById('leave').onclick = () => link.socket.close(1000, 'left the fleet');
  connect(device, link);
}

main();
