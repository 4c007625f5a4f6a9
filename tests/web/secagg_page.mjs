// The SecAgg+ vectors checked inside a Chromium page (tests/fleet/devices/test_secagg_chromium.py), where WebCrypto is
// BoringSSL's rather than Node's OpenSSL: keys, shared key, Fernet, masks, Shamir, quantization and one device's
// stage replies, each compared with what Flower 1.42.0 wrote (tests/web/secagg_vectors.json). Web APIs only.
const web = (name) => new URL(`../../ort_lightning/fleet/devices/web/${name}`, import.meta.url).href;
const crypto = await import(web('secagg_crypto.js'));
const { combineShares, createShares } = await import(web('secagg_shamir.js'));
const { MT19937, dequantize, maskArrays, quantize } = await import(web('secagg_masks.js'));
const { SecAggPlusClient } = await import(web('secagg.js'));

const ascii = (text) => new TextEncoder().encode(text);
const text = (bytes) => new TextDecoder().decode(bytes);
const b64 = (bytes) => crypto.toBase64(bytes);
const replay = (encoded) => {
  const stream = crypto.fromBase64(encoded);
  let offset = 0;
  return (size) => stream.slice(offset, (offset += size));
};

/** One device's four stages from the vector's keys and draws: its replies as Flower would write them. */
async function stageReplies(stages) {
  const generator = new MT19937(stages.collect.seed);
  const client = new SecAggPlusClient({ nodeId: BigInt(stages.nodes[1]), randomBytes: replay(stages.random),
    uniform: () => generator.nextDouble(), now: () => stages.time + 0.5 });
  await client.setup(stages.round, { sk1: ascii(stages.sk1), sk2: ascii(stages.sk2) });
  const shared = await client.shareKeys(stages.public_keys.map(([nid, a, b]) => [nid, [ascii(a), ascii(b)]]));
  const { collect, unmask } = stages;
  const arrays = collect.arrays.map((values, i) => ({ values: Float32Array.from(values), shape: collect.shapes[i] }));
  const masked = await client.collectMaskedVectors({ ctxts: collect.ctxts.map(ascii), srcs: collect.srcs.map(BigInt) },
    { numExamples: collect.num_examples, arrays });
  const shares = client.unmask({ active_nids: unmask.active_nids.map(BigInt), dead_nids: unmask.dead_nids.map(BigInt) });
  return [shared.ctxts.map(text), masked.masked_params.map(b64), shares.shares.map(b64)];
}

/**
 * Every check, by name: whether the page's result is Flower's.
 *
 * @param {object} vectors The parsed tests/web/secagg_vectors.json.
 * @returns {Promise<Object<string, boolean>>} Check name -> passed.
 */
export async function check(vectors) {
  const results = {};
  const same = (name, got, want) => { results[name] = JSON.stringify(got) === JSON.stringify(want); };
  const { keys } = vectors;
  const a = await crypto.bytesToPrivateKey(ascii(keys.a_private));
  same('public key', text(await crypto.publicKeyToBytes(await crypto.publicKeyOf(a))), keys.a_public);
  same('shared key', text(await crypto.generateSharedKey(a, await crypto.bytesToPublicKey(ascii(keys.b_public)))),
    keys.shared_key);
  const fresh = await crypto.generateKeyPair();
  const again = await crypto.bytesToPrivateKey(await crypto.privateKeyToBytes(fresh.privateKey));
  same('a new key through PKCS#8', b64(await crypto.publicKeyToBytes(await crypto.publicKeyOf(again))),
    b64(await crypto.publicKeyToBytes(fresh.publicKey)));
  for (const [i, v] of vectors.fernet.entries()) {
    const key = ascii(keys.shared_key);
    same(`fernet ${i}`, [text(await crypto.encrypt(key, crypto.fromBase64(v.plaintext), { iv: crypto.fromBase64(v.iv),
      time: v.time })), b64(await crypto.decrypt(key, ascii(v.token)))], [v.token, v.plaintext]);
  }
  for (const [i, v] of vectors.masks.entries()) {
    same(`masks ${i}`, maskArrays(crypto.fromBase64(v.seed), v.num_range, v.shapes).map((m) => Array.from(m)), v.masks);
  }
  for (const [i, v] of vectors.shamir.entries()) {
    const shares = createShares(crypto.fromBase64(v.secret), v.threshold, v.count, replay(v.random)).map(b64);
    same(`shamir ${i}`, [shares, b64(combineShares(v.subset.map((j) => crypto.fromBase64(v.shares[j - 1]))))],
      [v.shares, v.secret]);
  }
  for (const [i, v] of vectors.quantization.entries()) {
    const generator = new MT19937(v.seed);
    const type = v.dtype === 'float32' ? Float32Array : Float64Array;
    const q = v.arrays.map((values) => quantize(type.from(values), v.clipping_range, v.target_range,
      () => generator.nextDouble()));
    same(`quantization ${i}`, [q.map((x) => Array.from(x)),
      q.map((x) => Array.from(dequantize(x, v.clipping_range, v.target_range)))], [v.quantized, v.dequantized]);
  }
  for (const [i, stages] of vectors.stages.entries()) {
    same(`stages ${i}`, await stageReplies(stages),
      [stages.share_keys.ctxts, stages.collect.masked_params, stages.unmask.shares]);
  }
  return results;
}
