// The browser fleet's binary frames, on the device's side: the format that frames.py writes and reads.
//
//   uint32 little-endian H | H bytes of UTF-8 JSON header | zero padding to a multiple of 8 | payload
//
// With more than one blob, the header's "blobs" lists each one's [offset, nbytes] in the payload (offsets
// multiples of 8, so that a Float32Array or BigInt64Array views a blob in place); with one, the payload is
// the blob. A train frame's header names the weights' blob ("weights") and, per epoch, per batch, each
// tensor as {type, dims, blob}; a result frame is the header and the trained weights as float32.
// tests/web/frame_vectors.json holds frames written by each side, which both sides' tests decode.

import {ARRAYS} from '../../../web/wire.js';

const ALIGN = 8;

/**
 * A size rounded up to the alignment of blobs.
 *
 * @param {number} size Bytes.
 * @returns {number} The next multiple of 8.
 */
function padded(size) {
  return Math.ceil(size / ALIGN) * ALIGN;
}

/**
 * Writes one binary frame.
 *
 * @param {object} header The JSON header (a "blobs" key is added for more than one blob).
 * @param {Array<ArrayBufferView>} blobs The payload's parts, in order.
 * @returns {Uint8Array} The frame.
 */
export function pack(header, blobs) {
  const offsets = [];
  let offset = 0;
  for (const blob of blobs) {
    offsets.push([offset, blob.byteLength]);
    offset = padded(offset + blob.byteLength);
  }
  const text = new TextEncoder().encode(JSON.stringify(blobs.length > 1 ? {...header, blobs: offsets} : header));
  const start = padded(4 + text.length);
  const end = offsets.length > 0 ? offsets.at(-1)[0] + offsets.at(-1)[1] : 0;
  const frame = new Uint8Array(start + end);
  new DataView(frame.buffer).setUint32(0, text.length, true);
  frame.set(text, 4);
  blobs.forEach((blob, index) => {
    frame.set(new Uint8Array(blob.buffer, blob.byteOffset, blob.byteLength), start + offsets[index][0]);
  });
  return frame;
}

/**
 * Reads a binary frame's header and locates its blobs.
 *
 * @param {ArrayBuffer} buffer The frame (a WebSocket message with binaryType 'arraybuffer').
 * @returns {{header: object, blob: function(number): Uint8Array}} The header, and each blob's bytes (a view).
 */
export function unpack(buffer) {
  if (!(buffer instanceof ArrayBuffer) || buffer.byteLength < 4) {
    throw new Error(`expected a binary frame (an ArrayBuffer of at least 4 bytes), but got ${String(buffer)}; ` +
      "set the WebSocket's binaryType to 'arraybuffer'");
  }
  const length = new DataView(buffer).getUint32(0, true);
  if (4 + length > buffer.byteLength) {
    throw new Error(`a frame of ${buffer.byteLength} bytes claims a header of ${length} bytes; the frame is cut off`);
  }
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, length)));
  const start = padded(4 + length);
  const blobs = header.blobs ?? [[0, buffer.byteLength - start]];
  const blob = (index) => {
    const [at, bytes] = blobs[index] ?? [];
    if (at === undefined || start + at + bytes > buffer.byteLength) {
      throw new Error(`the frame has no blob ${index} (it lists ${blobs.length}, in ${buffer.byteLength} bytes)`);
    }
    return new Uint8Array(buffer, start + at, bytes);
  };
  return {header, blob};
}

/**
 * One tensor of a train frame, viewed in place.
 *
 * @param {{blob: function(number): Uint8Array}} frame What `unpack` returned.
 * @param {{type: string, dims: number[], blob: number}} tensor The header's entry.
 * @returns {{type: string, data: ArrayBufferView, dims: number[]}} The tensor as runner.js takes it.
 */
export function tensor(frame, {type, dims, blob}) {
  const kind = ARRAYS[type];
  if (kind === undefined) {
    throw new Error(`the frame holds a tensor of type ${JSON.stringify(type)}, but only ${Object.keys(ARRAYS)} ` +
      'travel; the server and the page are of different releases');
  }
  const bytes = frame.blob(blob);
  return {type, dims, data: new kind(bytes.buffer, bytes.byteOffset, bytes.byteLength / kind.BYTES_PER_ELEMENT)};
}

/**
 * A train frame's content: the round's weights and each epoch's batches.
 *
 * @param {ArrayBuffer} buffer The frame.
 * @returns {{header: object, weights: Float32Array, epochs: Array<Array<Array<object>>>}} The round.
 */
export function readTrain(buffer) {
  const frame = unpack(buffer);
  const {header} = frame;
  const bytes = frame.blob(header.weights);
  const weights = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  const epochs = header.epochs.map((batches) => batches.map((batch) => batch.map((t) => tensor(frame, t))));
  return {header, weights, epochs};
}

/**
 * A result frame: the reply's header and the trained weights.
 *
 * @param {object} header {type: 'result', id, examples, steps, losses, ...}.
 * @param {Float32Array} weights The trained weights.
 * @returns {Uint8Array} The frame.
 */
export function resultFrame(header, weights) {
  return pack(header, [weights]);
}

/**
 * A SecAgg+ record's [key, value] pairs as a frame carries them: bytes as {bytes: blob} (appended to `blobs`),
 * bigints (node ids) as {int: digits}; numbers and strings as they are (frames.py's encode_record).
 *
 * @param {object} record The record, by key (in the order the server sent its keys).
 * @param {Array<ArrayBufferView>} blobs The frame's blobs, appended to.
 * @returns {Array<Array<*>>} The pairs.
 */
export function encodeRecord(record, blobs) {
  const encode = (value) => {
    if (Array.isArray(value)) return value.map(encode);
    if (value instanceof Uint8Array) {
      blobs.push(value);
      return {bytes: blobs.length - 1};
    }
    return typeof value === 'bigint' ? {int: String(value)} : value;
  };
  return Object.entries(record).map(([key, value]) => [key, encode(value)]);
}

/**
 * A frame's SecAgg+ record as [key, value] pairs, its bytes viewed in place and its {int} values as bigints.
 *
 * @param {Array<Array<*>>} pairs The header's record.
 * @param {{blob: function(number): Uint8Array}} frame What `unpack` returned.
 * @returns {Array<Array<*>>} The decoded pairs, in the server's order (a node's share follows its place).
 */
export function decodeRecord(pairs, frame) {
  const decode = (value) => {
    if (Array.isArray(value)) return value.map(decode);
    if (value !== null && typeof value === 'object' && 'bytes' in value) return frame.blob(value.bytes);
    if (value !== null && typeof value === 'object' && 'int' in value) return BigInt(value.int);
    return value;
  };
  if (!Array.isArray(pairs)) {
    throw new Error(`the server sent a SecAgg+ record that is ${JSON.stringify(pairs)?.slice(0, 60)}, not [key, ` +
      'value] pairs; the server and the page are of different releases');
  }
  return pairs.map(([key, value]) => [key, decode(value)]);
}

/**
 * A secagg frame: one SecAgg+ stage's record, its bytes as blobs.
 *
 * @param {object} header {type: 'secagg', id, round, ...}.
 * @param {object} record The stage's answer, by key.
 * @returns {Uint8Array} The frame.
 */
export function recordFrame(header, record) {
  const blobs = [];
  const encoded = encodeRecord(record, blobs);
  return pack({...header, record: encoded}, blobs);
}
