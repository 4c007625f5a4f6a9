// The SecAgg+ client's four stages, as Flower 1.42.0's secaggplus_mod runs them (flwr.client.mod.secure_aggregation),
// for the browser and Node devices: setup (two P-384 key pairs), share keys (Shamir shares of the private mask
// seed and of the first private key, each Fernet-encrypted to its node), collect masked vectors (the weighted,
// quantized update plus the private mask and the pairwise masks, mod mod_range, as int64 .npy bytes) and unmask
// (the shares the server asks for). Node ids are bigints (Flower's are unsigned 64-bit). The record keys are
// Flower's (secaggplus_constants.Key); tests/web/secagg.test.mjs checks every step against Flower's Python.

import {
  bytesToPrivateKey, bytesToPublicKey, concatBytes, decrypt, encrypt, generateKeyPair, generateSharedKey,
  privateKeyToBytes, publicKeyOf, publicKeyToBytes,
} from './secagg_crypto.js';
import {createShares, randomBytesOf} from './secagg_shamir.js';
import {int64Npy, maskArrays, quantize} from './secagg_masks.js';

export const STAGES = ['setup', 'share_keys', 'collect_masked_vectors', 'unmask'];

/**
 * Flower's share_keys_plaintext_concat: uint64 source, uint64 destination, uint32 length (all little-endian),
 * the seed share, the private key share.
 *
 * @param {bigint} src The source node id.
 * @param {bigint} dst The destination node id.
 * @param {Uint8Array} bShare The mask seed's share.
 * @param {Uint8Array} skShare The private key's share.
 * @returns {Uint8Array} The plaintext.
 */
export function shareKeysPlaintextConcat(src, dst, bShare, skShare) {
  const head = new Uint8Array(20);
  const view = new DataView(head.buffer);
  view.setBigUint64(0, BigInt(src), true);
  view.setBigUint64(8, BigInt(dst), true);
  view.setUint32(16, bShare.length, true);
  return concatBytes([head, bShare, skShare]);
}

/**
 * Flower's share_keys_plaintext_separate.
 *
 * @param {Uint8Array} plaintext The plaintext.
 * @returns {[bigint, bigint, Uint8Array, Uint8Array]} Source, destination, seed share, private key share.
 */
export function shareKeysPlaintextSeparate(plaintext) {
  const view = new DataView(plaintext.buffer, plaintext.byteOffset, plaintext.byteLength);
  const length = view.getUint32(16, true);
  return [view.getBigUint64(0, true), view.getBigUint64(8, true), plaintext.slice(20, 20 + length),
    plaintext.slice(20 + length)];
}

/**
 * Python's round(): halves to even.
 *
 * @param {number} x The value.
 * @returns {number} The nearest integer, ties to even.
 */
function roundHalfEven(x) {
  const floor = Math.floor(x);
  const rest = x - floor;
  if (rest !== 0.5) return Math.round(x);
  return floor % 2 === 0 ? floor : floor + 1;
}

/**
 * A source of doubles in [0, 1) from WebCrypto, 53 bits each (the stochastic rounding's draws on a device),
 * drawn 8192 at a time: one getRandomValues call a value made rounding a million values take seconds.
 *
 * @returns {function(): number} The source.
 */
function cryptoUniform() {
  const words = new Uint32Array(16384);
  let next = words.length;
  return () => {
    if (next >= words.length) {
      globalThis.crypto.getRandomValues(words);
      next = 0;
    }
    next += 2;
    return ((words[next - 2] >>> 5) * 67108864 + (words[next - 1] >>> 6)) / 9007199254740992;
  };
}

/** One device's side of a SecAgg+ round, stage by stage (the state Flower's mod keeps in its context). */
export class SecAggPlusClient {
  /**
   * @param {object} options The device.
   * @param {bigint} options.nodeId This node's id (the message's destination node id).
   * @param {function(number): Uint8Array} [options.randomBytes] Random bytes (WebCrypto's by default).
   * @param {function(): number} [options.uniform] Doubles in [0, 1) for the stochastic rounding.
   * @param {function(): number} [options.now] Seconds since the epoch, for Fernet's timestamps.
   */
  constructor({nodeId, randomBytes = randomBytesOf, uniform = cryptoUniform(), now = () => Date.now() / 1000}) {
    this.nodeId = BigInt(nodeId);
    this.random = {randomBytes, uniform, now};
    this.stage = 'unmask';
  }

  /**
   * Checks that a stage may follow the last one, as Flower's check_stage does, and moves to it.
   *
   * @param {string} next The stage the server asks for.
   */
  enter(next) {
    const expected = STAGES[(STAGES.indexOf(this.stage) + 1) % STAGES.length];
    if (next !== 'setup' && next !== expected) {
      throw new Error(`Abort secure aggregation: expect ${expected} stage, but receive ${next} stage`);
    }
    this.stage = next;
  }

  /**
   * Stage 0: keeps the round's parameters and makes two key pairs.
   *
   * @param {object} configs Flower's setup record: sample_num, share_num, threshold, clipping_range, target_range,
   *   mod_range, max_weight.
   * @param {{sk1: Uint8Array, sk2: Uint8Array}} [keys] Fixed private keys (PEM), for tests; new ones by default.
   * @returns {Promise<{pk1: Uint8Array, pk2: Uint8Array}>} The public keys.
   */
  async setup(configs, keys) {
    this.enter('setup');
    const required = ['sample_num', 'share_num', 'threshold', 'clipping_range', 'target_range', 'mod_range', 'max_weight'];
    for (const key of required) {
      if (typeof configs[key] !== 'number') throw new Error(`Stage setup: the required key '${key}' is missing ` +
        `from the ConfigRecord or not a number (got ${String(configs[key])})`);
    }
    this.configs = {...configs};
    this.rdSeedShares = new Map();
    this.sk1Shares = new Map();
    this.ss2 = new Map();
    const [sk1, sk2] = keys ? [await bytesToPrivateKey(keys.sk1), await bytesToPrivateKey(keys.sk2)]
      : [(await generateKeyPair()).privateKey, (await generateKeyPair()).privateKey];
    this.sk1 = sk1;
    this.sk2 = sk2;
    this.sk1Bytes = keys ? keys.sk1 : await privateKeyToBytes(sk1);
    this.pk1 = await publicKeyToBytes(await publicKeyOf(sk1));
    this.pk2 = await publicKeyToBytes(await publicKeyOf(sk2));
    return {pk1: this.pk1, pk2: this.pk2};
  }

  /**
   * Stage 1: shares the private mask seed and the first private key, one encrypted share per other node.
   *
   * @param {Array<[bigint|string, [Uint8Array, Uint8Array]]>} publicKeys Each node's (pk1, pk2), in the
   *   record's order (a share's index follows it).
   * @returns {Promise<{dsts: Array<bigint>, ctxts: Array<Uint8Array>}>} The destinations and their ciphertexts.
   */
  async shareKeys(publicKeys) {
    this.enter('share_keys');
    this.publicKeys = new Map(publicKeys.map(([nid, pair]) => [BigInt(nid), pair]));
    const {threshold, share_num: shareNum} = this.configs;
    if (this.publicKeys.size < threshold) throw new Error('Available neighbours number smaller than threshold');
    const all = [...this.publicKeys.values()].flat().map((pk) => pk.join(','));
    if (new Set(all).size !== all.length) throw new Error('Some public keys are identical');
    const own = this.publicKeys.get(this.nodeId);
    if (!own || !equalBytes(own[0], this.pk1) || !equalBytes(own[1], this.pk2)) {
      throw new Error('Own public keys are displayed in dict incorrectly, should not happen!');
    }
    const {randomBytes, now} = this.random;
    this.rdSeed = randomBytes(32);
    const bShares = createShares(this.rdSeed, threshold, shareNum, randomBytes);
    const skShares = createShares(this.sk1Bytes, threshold, shareNum, randomBytes);
    const dsts = [];
    const ctxts = [];
    let index = 0;
    for (const [nid, [, pk2]] of this.publicKeys) {
      if (nid === this.nodeId) {
        this.rdSeedShares.set(nid, bShares[index]);
        this.sk1Shares.set(nid, skShares[index]);
      } else {
        const shared = await generateSharedKey(this.sk2, await bytesToPublicKey(pk2));
        this.ss2.set(nid, shared);
        const plaintext = shareKeysPlaintextConcat(this.nodeId, nid, bShares[index], skShares[index]);
        ctxts.push(await encrypt(shared, plaintext, {iv: randomBytes(16), time: Math.floor(now())}));
        dsts.push(nid);
      }
      index += 1;
    }
    return {dsts, ctxts};
  }

  /**
   * Stage 2: reads the shares sent to this node, then masks the trained update.
   *
   * @param {{ctxts: Array<Uint8Array>, srcs: Array<bigint>}} configs The ciphertexts sent here and their sources.
   * @param {{numExamples: number, arrays: Array<{values: Float32Array|Float64Array, shape: Array<number>}>}} fit
   *   The example count and the trained arrays (the legacy fit reply's parameters).
   * @returns {Promise<{masked_params: Array<Uint8Array>}>} The masked arrays as int64 .npy bytes, the weight first.
   */
  async collectMaskedVectors(configs, {numExamples, arrays}) {
    this.enter('collect_masked_vectors');
    const {threshold, max_weight: maxWeight, clipping_range: clipping, target_range: target} = this.configs;
    const srcs = configs.srcs.map(BigInt);
    if (configs.ctxts.length + 1 < threshold) throw new Error('Not enough available neighbour clients.');
    for (const [i, src] of srcs.entries()) {
      const key = known(this.ss2, src, `Node ${this.nodeId}: received a ciphertext from Node ${src}`);
      const [actual, dst, bShare, skShare] = shareKeysPlaintextSeparate(await decrypt(key, configs.ctxts[i]));
      if (actual !== src) throw new Error(`Node ${this.nodeId}: received ciphertext from ${actual} instead of ${src}.`);
      if (dst !== this.nodeId) throw new Error(`Node ${this.nodeId}: received an encrypted message` +
        `for Node ${dst} from Node ${src}.`);
      this.rdSeedShares.set(src, bShare);
      this.sk1Shares.set(src, skShare);
    }
    const qRatio = roundHalfEven((numExamples / maxWeight) * target);
    const quantized = arrays.map(({values}) => quantize(weighted(values, qRatio / target), clipping, target,
      this.random.uniform));
    const vectors = [Float64Array.of(qRatio), ...quantized.map((q) => Float64Array.from(q))];
    const shapes = [[1], ...arrays.map(({shape}) => shape)];
    await this.addMasks(vectors, shapes, srcs);
    return {masked_params: vectors.map((v, i) => int64Npy(v, shapes[i]))};
  }

  /**
   * Adds the private mask and, per source, the pairwise mask (plus when this node's id is the larger), mod mod_range.
   *
   * @param {Array<Float64Array>} vectors The quantized arrays, changed in place.
   * @param {Array<Array<number>>} shapes Their shapes.
   * @param {Array<bigint>} srcs The other nodes of the round.
   */
  async addMasks(vectors, shapes, srcs) {
    const modulus = this.configs.mod_range;
    // Every value stays in [0, modulus): a sum or difference of two such is one modulus away at most.
    const add = (masks, sign) => vectors.forEach((v, a) => {
      const mask = masks[a];
      for (let i = 0; i < v.length; i += 1) {
        const x = v[i] + sign * mask[i];
        v[i] = x >= modulus ? x - modulus : x < 0 ? x + modulus : x;
      }
    });
    vectors.forEach((v) => v.forEach((x, i) => { v[i] = x % modulus; }));
    add(maskArrays(this.rdSeed, modulus, shapes), 1);
    for (const src of srcs) {
      const shared = await generateSharedKey(this.sk1, await bytesToPublicKey(this.publicKeys.get(src)[0]));
      add(maskArrays(shared, modulus, shapes), this.nodeId > src ? 1 : -1);
    }
  }

  /**
   * Stage 3: the mask seed's shares of the nodes still in, the private key's shares of those that dropped.
   *
   * @param {{active_nids: Array<bigint>, dead_nids: Array<bigint>}} configs The server's lists.
   * @returns {{nids: Array<bigint>, shares: Array<Uint8Array>}} The node ids and their shares, in that order.
   */
  unmask(configs) {
    this.enter('unmask');
    const active = configs.active_nids.map(BigInt);
    const dead = configs.dead_nids.map(BigInt);
    if (active.length < this.configs.threshold) throw new Error('Available neighbours number smaller than threshold');
    const asked = `Node ${this.nodeId}: the server asked for the share of Node`;
    return {nids: [...active, ...dead], shares: [...active.map((nid) => known(this.rdSeedShares, nid, `${asked} ${nid}`)),
      ...dead.map((nid) => known(this.sk1Shares, nid, `${asked} ${nid}`))]};
  }
}

/**
 * An array times the weight's factor, in the array's own precision (numpy keeps float32 for a Python float).
 *
 * @param {Float32Array|Float64Array} values The array.
 * @param {number} factor The factor.
 * @returns {Float32Array|Float64Array} The product.
 */
export function weighted(values, factor) {
  return values instanceof Float32Array ? values.map((v) => v * Math.fround(factor)) : values.map((v) => v * factor);
}

/**
 * A neighbour's entry, or an error naming the node that is not a neighbour.
 *
 * @param {Map<bigint, *>} map Entries by node id.
 * @param {bigint} nid The node.
 * @param {string} what What asked for it.
 * @returns {*} The entry.
 */
function known(map, nid, what) {
  if (!map.has(nid)) throw new Error(`${what}, which is not one of its neighbours [${[...map.keys()].join(', ')}]; ` +
    'the server mixed up the rounds or the nodes of this SecAgg+ round');
  return map.get(nid);
}

/**
 * Whether two byte arrays are equal.
 *
 * @param {Uint8Array} a Bytes.
 * @param {Uint8Array} b Bytes.
 * @returns {boolean} Equal.
 */
function equalBytes(a, b) {
  return a.length === b.length && a.every((byte, i) => byte === b[i]);
}
