// Unit tests of frames.js, the device's frame codec, on the vectors frames.py wrote (tests/web/frame_vectors.json,
// tests/fleet/devices/frame_vectors.py): Python's train frames decode here to the tensors listed beside them, and the result
// frames this codec writes are Python's bytes, which tests/fleet/devices/test_frame_vectors.py reads back with frames.py.
// SecAgg+'s records likewise: the server's decode to the listed values (bytes as Uint8Array, node ids past 2**53 as
// bigints), and a device's secagg frame written here is Python's, byte for byte.
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { test } from 'node:test';

const { decodeRecord, pack, readTrain, recordFrame, resultFrame, unpack } = await import(
  new URL('../../ort_lightning/fleet/devices/web/frames.js', import.meta.url).href);
const { ARRAYS } = await import(new URL('../../ort_lightning/web/wire.js', import.meta.url).href);
const VECTORS = JSON.parse(await readFile(new URL('frame_vectors.json', import.meta.url), 'utf8'));

/** The bytes of a vector's frame, in an ArrayBuffer of their own (as a WebSocket delivers them). */
const frameOf = (vector) => {
  const bytes = Buffer.from(vector.frame, 'base64');
  return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength);
};
const expected = ({ type, dims, data }) => ({
  type, dims, data: type === 'int64' ? BigInt64Array.from(data, BigInt) : ARRAYS[type].from(data),
});
/** A listed record value as the device holds it: {b64} as a Uint8Array, {bigint} as a bigint (frame_vectors.py's tags). */
const untagged = (value) => {
  if (Array.isArray(value)) return value.map(untagged);
  if (value !== null && typeof value === 'object') {
    return 'b64' in value ? new Uint8Array(Buffer.from(value.b64, 'base64')) : BigInt(value.bigint);
  }
  return value;
};

for (const vector of VECTORS.train) {
  test(`Python's train frame ${vector.id} decodes to its weights and tensors`, () => {
    const { header, weights, epochs } = readTrain(frameOf(vector));
    assert.equal(header.type, 'train');
    assert.equal(header.id, vector.id);
    assert.equal(header.round, vector.round);
    assert.deepEqual(header.local ?? null, vector.local);
    assert.deepEqual(weights, Float32Array.from(vector.weights));
    assert.deepEqual(epochs, vector.epochs.map((batches) => batches.map((batch) => batch.map(expected))));
    // Every tensor is a view of the frame, aligned for its typed array, not a copy.
    for (const t of epochs.flat(2)) assert.equal(t.data.byteOffset % t.data.BYTES_PER_ELEMENT, 0);
  });

  test(`the train frame ${vector.id} written again from its header and blobs is Python's, byte for byte`, () => {
    const frame = unpack(frameOf(vector));
    const count = frame.header.blobs?.length ?? 1;
    const blobs = Array.from({ length: count }, (_, index) => frame.blob(index));
    assert.deepEqual(pack(frame.header, blobs), new Uint8Array(frameOf(vector)));
  });
}

for (const vector of VECTORS.result) {
  test(`a result frame (${vector.header.id}) is written as frames.py writes it`, () => {
    const written = resultFrame(vector.header, Float32Array.from(vector.weights));
    assert.deepEqual(written, new Uint8Array(frameOf(vector)));
    const { header, blob } = unpack(written.buffer);
    assert.deepEqual(header, vector.header);
    assert.deepEqual(new Float32Array(blob(0).slice().buffer), Float32Array.from(vector.weights));
  });
}

for (const vector of VECTORS.secagg) {
  test(`Python's secagg frame ${vector.id} decodes to its record, in the server's key order`, () => {
    const frame = unpack(frameOf(vector));
    assert.deepEqual([frame.header.type, frame.header.id, frame.header.round, frame.header.node],
      ['secagg', vector.id, vector.round, vector.node]);
    assert.deepEqual(decodeRecord(frame.header.record, frame), untagged(vector.record));
  });
}

test('a node id past 2**53 arrives as the bigint Python sent, where a JSON number would have rounded it', () => {
  const frame = unpack(frameOf(VECTORS.secagg[0]));
  const record = Object.fromEntries(decodeRecord(frame.header.record, frame));
  assert.equal(BigInt(frame.header.node), 2n ** 63n + 5n);
  assert.deepEqual(record.active_nids, [3, 2n ** 63n + 5n, 2n ** 53n + 1n]);
  assert.notEqual(BigInt(Number('9007199254740993')), 2n ** 53n + 1n);
  // An object would put the integer-like key "3" first; the pairs keep the server's order, which the shares follow.
  assert.deepEqual(decodeRecord(frame.header.record, frame).map(([key]) => key).slice(0, 3),
    ['stage', String(2n ** 63n + 5n), '3']);
});

for (const vector of VECTORS.collect) {
  test(`Python's collect stage ${vector.id} is a train frame with its record and the parameters' places`, () => {
    const buffer = frameOf(vector);
    const { header, weights } = readTrain(buffer);
    assert.deepEqual([header.type, header.id, header.round], ['train', vector.id, vector.round]);
    assert.deepEqual(weights, Float32Array.from(vector.weights));
    assert.deepEqual(header.layout, vector.layout);
    assert.deepEqual(decodeRecord(header.secagg, unpack(buffer)), untagged(vector.record));
  });
}

for (const vector of VECTORS.reply) {
  test(`a device's secagg frame (${vector.header.id}) is written as frames.py writes it`, () => {
    const record = Object.fromEntries(untagged(vector.record));
    const written = recordFrame(vector.header, record);
    assert.deepEqual(written, new Uint8Array(frameOf(vector)));
  });
}

test('a cut-off frame, a missing blob and an unknown tensor type are named', () => {
  const frame = new Uint8Array(frameOf(VECTORS.train[0]));
  assert.throws(() => unpack(frame.slice(0, 40).buffer), { message: /claims a header of \d+ bytes; the frame is cut off/ });
  assert.throws(() => unpack(new ArrayBuffer(2)), { message: /^expected a binary frame \(an ArrayBuffer of at least 4/ });
  assert.throws(() => unpack(frame.buffer).blob(99), { message: /^the frame has no blob 99 \(it lists 7,/ });
  const odd = pack({ type: 'train', id: 'x', round: 1, weights: 0, epochs: [[[{ type: 'float64', dims: [1], blob: 1 }]]] },
    [new Float32Array(1), new Float64Array(1)]);
  assert.throws(() => readTrain(odd.buffer), { message: /a tensor of type "float64", but only float32,int64,int32,bool travel/ });
  assert.throws(() => decodeRecord({ stage: 'setup' }, unpack(frame.buffer)),
    { message: /^the server sent a SecAgg\+ record that is \{"stage":"setup"\}, not \[key, value\] pairs/ });
});
