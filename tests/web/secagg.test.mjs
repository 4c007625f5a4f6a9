// Unit tests of the JavaScript SecAgg+ client's primitives against Flower's own Python (tests/web/secagg_vectors.json,
// written by tests/fleet/devices/secagg_vectors.py with flwr 1.42.0): keys, shared key, Fernet both ways,
// masks, Shamir, quantization, the share-keys plaintext and the .npy bytes, byte for byte; then one device's stage
// replies against those of Flower's secaggplus_mod for the same keys and draws.
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { test } from 'node:test';

const web = (name) => new URL(`../../ort_lightning/fleet/devices/web/${name}`, import.meta.url).href;
const crypto = await import(web('secagg_crypto.js'));
const { combineShares, createShares } = await import(web('secagg_shamir.js'));
const { MT19937, dequantize, int64Npy, maskArrays, quantize } = await import(web('secagg_masks.js'));
const { SecAggPlusClient, shareKeysPlaintextConcat, shareKeysPlaintextSeparate, weighted } = await import(
  web('secagg.js'));
const VECTORS = JSON.parse(await readFile(new URL('secagg_vectors.json', import.meta.url), 'utf8'));

const ascii = (text) => new TextEncoder().encode(text);
const bytes = (b64) => crypto.fromBase64(b64);
const replay = (b64) => {
  const stream = bytes(b64);
  let offset = 0;
  return (size) => stream.slice(offset, (offset += size));
};
const { keys } = VECTORS;

test('the vectors come from the pinned Flower', () => assert.equal(VECTORS.flwr, '1.42.0'));

test("Flower's PEM keys read back, and a private key's public key is Flower's PEM byte for byte", async () => {
  for (const side of ['a', 'b']) {
    const privateKey = await crypto.bytesToPrivateKey(ascii(keys[`${side}_private`]));
    const publicKey = await crypto.publicKeyOf(privateKey);
    assert.deepEqual(await crypto.publicKeyToBytes(publicKey), ascii(keys[`${side}_public`]));
    const again = await crypto.bytesToPublicKey(ascii(keys[`${side}_public`]));
    assert.deepEqual(await crypto.publicKeyToBytes(again), ascii(keys[`${side}_public`]));
  }
});

test("the ECDH + HKDF shared key is Flower's generate_shared_key, from either side", async () => {
  const a = await crypto.bytesToPrivateKey(ascii(keys.a_private));
  const b = await crypto.bytesToPrivateKey(ascii(keys.b_private));
  const aPublic = await crypto.bytesToPublicKey(ascii(keys.a_public));
  const bPublic = await crypto.bytesToPublicKey(ascii(keys.b_public));
  assert.deepEqual(await crypto.generateSharedKey(a, bPublic), ascii(keys.shared_key));
  assert.deepEqual(await crypto.generateSharedKey(b, aPublic), ascii(keys.shared_key));
});

test("a generated key pair's private PEM reads back to the same public key", async () => {
  const { privateKey, publicKey } = await crypto.generateKeyPair();
  const again = await crypto.bytesToPrivateKey(await crypto.privateKeyToBytes(privateKey));
  assert.deepEqual(await crypto.publicKeyToBytes(await crypto.publicKeyOf(again)),
    await crypto.publicKeyToBytes(publicKey));
});

for (const [index, vector] of VECTORS.fernet.entries()) {
  test(`Fernet ${index}: encryption with Flower's IV and time is Flower's token; Flower's token decrypts`, async () => {
    const key = ascii(keys.shared_key);
    const plaintext = bytes(vector.plaintext);
    const token = await crypto.encrypt(key, plaintext, { iv: bytes(vector.iv), time: vector.time });
    assert.equal(new TextDecoder().decode(token), vector.token);
    assert.deepEqual(await crypto.decrypt(key, ascii(vector.token)), plaintext);
  });
}

test('a Fernet token under another key or altered is refused', async () => {
  const token = ascii(VECTORS.fernet[1].token);
  const other = ascii(crypto.toBase64(new Uint8Array(32), true));
  await assert.rejects(crypto.decrypt(other, token), /HMAC does not match/);
  const altered = crypto.fromBase64(VECTORS.fernet[1].token);
  altered[30] ^= 1;
  await assert.rejects(crypto.decrypt(ascii(keys.shared_key), ascii(crypto.toBase64(altered, true))),
    /HMAC does not match/);
});

for (const [index, vector] of VECTORS.masks.entries()) {
  test(`masks ${index}: pseudo_rand_gen(seed of ${bytes(vector.seed).length} bytes, ${vector.num_range})`, () => {
    const masks = maskArrays(bytes(vector.seed), vector.num_range, vector.shapes);
    assert.deepEqual(masks.map((m) => Array.from(m)), vector.masks);
  });
}

test('a mod_range beyond 32-bit draws is refused in one line', () => {
  assert.throws(() => maskArrays(new Uint8Array(4), 2 ** 40, [[1]]), /expected a mod_range from 2 to 2\^32 \+ 1/);
});

for (const [index, vector] of VECTORS.shamir.entries()) {
  test(`Shamir ${index}: ${vector.count} shares at threshold ${vector.threshold} are Flower's, and combine`, () => {
    const secret = bytes(vector.secret);
    const shares = createShares(secret, vector.threshold, vector.count, replay(vector.random));
    assert.deepEqual(shares.map((s) => crypto.toBase64(s)), vector.shares);
    assert.deepEqual(combineShares(vector.subset.map((i) => bytes(vector.shares[i - 1]))), secret);
  });
}

test('fewer shares than the threshold do not give the secret back', () => {
  const vector = VECTORS.shamir[0];
  assert.throws(() => combineShares([bytes(vector.shares[0]), bytes(vector.shares[1])]), /Failed to combine shares/);
});

for (const [index, vector] of VECTORS.quantization.entries()) {
  test(`quantization ${index} (${vector.dtype}, clip ${vector.clipping_range}, ${vector.target_range})`, () => {
    const generator = new MT19937(vector.seed);
    const type = vector.dtype === 'float32' ? Float32Array : Float64Array;
    const quantized = vector.arrays.map((values) =>
      quantize(type.from(values), vector.clipping_range, vector.target_range, () => generator.nextDouble()));
    assert.deepEqual(quantized.map((q) => Array.from(q)), vector.quantized);
    const dequantized = quantized.map((q) => dequantize(q, vector.clipping_range, vector.target_range));
    assert.deepEqual(dequantized.map((d) => Array.from(d)), vector.dequantized);
  });
}

test("the update times the weight's factor is Flower's parameters_multiply, in float32", () => {
  const { values, factor, product } = VECTORS.weighting;
  assert.deepEqual(Array.from(weighted(Float32Array.from(values), factor)), product);
  assert.notDeepEqual(Array.from(Float32Array.from(values, (v) => v * factor)), product);
});

for (const vector of VECTORS.plaintexts) {
  test(`share_keys_plaintext_concat(${vector.src}, ${vector.dst}) and its separate`, () => {
    const plaintext = shareKeysPlaintextConcat(BigInt(vector.src), BigInt(vector.dst), bytes(vector.b_share),
      bytes(vector.sk_share));
    assert.equal(crypto.toBase64(plaintext), vector.plaintext);
    const [src, dst, bShare, skShare] = shareKeysPlaintextSeparate(bytes(vector.plaintext));
    assert.deepEqual([src, dst, crypto.toBase64(bShare), crypto.toBase64(skShare)],
      [BigInt(vector.src), BigInt(vector.dst), vector.b_share, vector.sk_share]);
  });
}

for (const vector of VECTORS.npy) {
  test(`ndarray_to_bytes of an int64 array of shape [${vector.shape}]`, () => {
    assert.equal(crypto.toBase64(int64Npy(vector.values, vector.shape)), vector.npy);
  });
}

for (const stages of VECTORS.stages) {
  test(`one device's stage replies are Flower's secaggplus_mod's (${JSON.stringify(stages.round)})`, async () => {
    const generator = new MT19937(stages.collect.seed);
    const client = new SecAggPlusClient({ nodeId: BigInt(stages.nodes[1]), randomBytes: replay(stages.random),
      uniform: () => generator.nextDouble(), now: () => stages.time + 0.5 });
    const { pk1, pk2 } = await client.setup(stages.round, { sk1: ascii(stages.sk1), sk2: ascii(stages.sk2) });
    assert.deepEqual([pk1, pk2], stages.public_keys[1].slice(1).map(ascii));

    const shared = await client.shareKeys(stages.public_keys.map(([nid, a, b]) => [nid, [ascii(a), ascii(b)]]));
    assert.deepEqual(shared.dsts.map(String), stages.share_keys.dsts);
    assert.deepEqual(shared.ctxts.map((c) => new TextDecoder().decode(c)), stages.share_keys.ctxts);

    const { collect } = stages;
    const arrays = collect.arrays.map((values, i) => ({ values: Float32Array.from(values), shape: collect.shapes[i] }));
    const masked = await client.collectMaskedVectors(
      { ctxts: collect.ctxts.map(ascii), srcs: collect.srcs.map(BigInt) }, { numExamples: collect.num_examples, arrays });
    assert.deepEqual(masked.masked_params.map((b) => crypto.toBase64(b)), collect.masked_params);

    const { unmask } = stages;
    const shares = client.unmask({ active_nids: unmask.active_nids.map(BigInt), dead_nids: unmask.dead_nids.map(BigInt) });
    assert.deepEqual(shares.nids.map(String), unmask.nids);
    assert.deepEqual(shares.shares.map((b) => crypto.toBase64(b)), unmask.shares);
  });
}

test('a stage out of order is refused as Flower refuses it', async () => {
  const client = new SecAggPlusClient({ nodeId: 1n });
  await assert.rejects(client.shareKeys([]), /expect setup stage, but receive share_keys stage/);
  await assert.rejects(client.setup({ sample_num: 3 }), /Stage setup: the required key 'share_num' is missing/);
});

test('a share asked for a node that is not a neighbour is refused by name', async () => {
  const [stages] = VECTORS.stages;
  const client = new SecAggPlusClient({ nodeId: BigInt(stages.nodes[1]) });
  await client.setup(stages.round, { sk1: ascii(stages.sk1), sk2: ascii(stages.sk2) });
  await client.shareKeys(stages.public_keys.map(([nid, a, b]) => [nid, [ascii(a), ascii(b)]]));
  await assert.rejects(client.collectMaskedVectors({ ctxts: [ascii(stages.collect.ctxts[0])], srcs: [99n] },
    { numExamples: 1, arrays: [] }), /received a ciphertext from Node 99, which is not one of its neighbours/);
});

test("inputs that are not SecAgg+'s are refused in one line each", async () => {
  await assert.rejects(crypto.bytesToPublicKey(ascii('nonsense')), /expected a PEM PUBLIC KEY/);
  await assert.rejects(crypto.encrypt(ascii('c2hvcnQ='), new Uint8Array(1)), /expected a Fernet key of 32 bytes/);
  await assert.rejects(crypto.decrypt(ascii(keys.shared_key), ascii('gAAAAA==')), /expected a Fernet token/);
  assert.throws(() => createShares(new Uint8Array(4), 3, 2), /expected 1 <= threshold <= count < 2\^32/);
  assert.throws(() => maskArrays(new Uint8Array(3), 2 ** 32, [[1]]), /expected a mask seed of a multiple of 4 bytes/);
});
