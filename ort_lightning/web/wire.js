// What a web device shares with the fleet's server and with the runner: the wire's message types and close codes
// (wire.json, which the server reads too), the tensor types a frame or a batch carries, and how a device reaches the
// server (its join URL, the server's files as bytes, joining again after a restart).

import WIRE from './wire.json' with {type: 'json'};

/** Every message type, by name: the server's (welcome, admitted, notice, train) and the device's (ready, ...). */
export const MESSAGE = Object.freeze(Object.fromEntries(
  [...Object.keys(WIRE.messages.server), ...Object.keys(WIRE.messages.device)].map((type) => [type, type])));
/** The server's message types, which a device handles; the device's, which the server handles. */
export const SERVER_MESSAGES = Object.freeze(Object.keys(WIRE.messages.server));
export const DEVICE_MESSAGES = Object.freeze(Object.keys(WIRE.messages.device));
/** WebSocket close codes: left (the leave button), refused, too_big, run_finished (an application code). */
export const CLOSE = Object.freeze({...WIRE.closes});
/** Close codes after which a device does not join again: leaving, a refusal, the run's end. */
export const FINAL_CLOSES = Object.freeze([CLOSE.left, CLOSE.refused, CLOSE.run_finished]);

/** The typed array of each tensor type a frame or a batch carries. */
export const ARRAYS = Object.freeze({float32: Float32Array, int64: BigInt64Array, int32: Int32Array, bool: Uint8Array});

/**
 * The fleet's WebSocket URL from the URL it printed (or the page's own).
 *
 * @param {string} fleetUrl The fleet's URL (http or https, with ?token=...).
 * @param {string} [name] The device's name, when the URL does not say it.
 * @returns {URL} ws(s)://HOST:PORT/join?token=...
 */
export function joinUrl(fleetUrl, name = '') {
  const base = new URL(fleetUrl);
  const join = new URL('join', base);
  join.protocol = base.protocol === 'https:' ? 'wss:' : 'ws:';
  join.search = base.search;
  if (name) join.searchParams.set('name', name);
  return join;
}

/**
 * Reads a file of the fleet's server.
 *
 * @param {string} url Its URL, or its path on the server.
 * @param {string} [base] The fleet's URL, for a path (Node's fetch takes no relative URL).
 * @returns {Promise<Uint8Array>} Its bytes.
 */
export async function fetchBytes(url, base) {
  const response = await fetch(base === undefined ? url : new URL(url, base));
  if (!response.ok) throw new Error(`GET ${url} answered ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

/**
 * Keeps a device in the fleet across server restarts: connects, and whenever the connection ends with a code that
 * is not final (FINAL_CLOSES), connects again every `every` ms until it is back or `patience` ms have passed
 * without a connection.
 *
 * @param {function(): Promise<{opened: boolean, code: ?number}>} connect One connection, until it ends.
 * @param {{every: number, patience: number, retrying?: function(?number): void}} options `retrying` hears each
 *     code that is followed by another try.
 * @returns {Promise<?number>} The final close code, or null once patience ran out.
 */
export async function stay(connect, {every, patience, retrying}) {
  let since = null;
  for (;;) {
    const {opened, code} = await connect();
    if (opened) since = null;
    if (FINAL_CLOSES.includes(code)) return code;
    since ??= Date.now();
    if (Date.now() - since > patience) return null;
    retrying?.(code);
    await new Promise((resolve) => setTimeout(resolve, every));
  }
}
