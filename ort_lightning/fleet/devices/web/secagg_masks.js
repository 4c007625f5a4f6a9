// SecAgg+'s numbers as Flower 1.42.0 makes them (tests/web/secagg_vectors.json pins each against Flower's Python):
//
// - masks: flwr.common.secure_aggregation.secaggplus_utils.pseudo_rand_gen, that is numpy's legacy
//   RandomState (MT19937 seeded by init_genrand with the seed's little-endian 32-bit words XORed together)
//   drawing randint(0, num_range - 1, dtype=int64): 32-bit draws masked to the range's bit width, rejected
//   above it. maskArrays is the one place that knows this: a new Flower generator is a change here only;
// - stochastic quantization: flwr.common.secure_aggregation.quantization (clip, shift, scale, ceil, then one
//   down with probability ceil - x), in float32 arithmetic for float32 updates, as numpy computes it;
// - the masked vectors' wire form: numpy's .npy bytes of int64 arrays (flwr's ndarray_to_bytes).

const N = 624;
const M = 397;

/**
 * MT19937's twist of two neighbouring words: the top bit of one, the low 31 of the next, through the matrix.
 *
 * @param {number} upper The word whose top bit is kept.
 * @param {number} lower The next word.
 * @returns {number} The value XORed into the word M ahead.
 */
function mix(upper, lower) {
  const y = (upper & 0x80000000) | (lower & 0x7fffffff);
  return (y >>> 1) ^ (y & 1 ? 0x9908b0df : 0);
}

/** numpy's MT19937 (legacy RandomState seeding with a 32-bit integer, init_genrand). */
export class MT19937 {
  /**
   * @param {number} seed A 32-bit unsigned seed.
   */
  constructor(seed) {
    this.state = new Uint32Array(N);
    this.state[0] = seed >>> 0;
    for (let i = 1; i < N; i += 1) {
      const previous = this.state[i - 1] ^ (this.state[i - 1] >>> 30);
      this.state[i] = (Math.imul(1812433253, previous) + i) >>> 0;
    }
    this.index = N;
  }

  /** Regenerates the 624 words. */
  twist() {
    const s = this.state;
    let i = 0;
    // NOTE: three runs without a modulo (the reference's loops); a modulo per word made masks twice as slow.
    for (; i < N - M; i += 1) s[i] = s[i + M] ^ mix(s[i], s[i + 1]);
    for (; i < N - 1; i += 1) s[i] = s[i + M - N] ^ mix(s[i], s[i + 1]);
    s[N - 1] = s[M - 1] ^ mix(s[N - 1], s[0]);
    this.index = 0;
  }

  /**
   * The next 32-bit output (numpy's next_uint32).
   *
   * @returns {number} An unsigned 32-bit integer.
   */
  nextUint32() {
    if (this.index >= N) this.twist();
    let y = this.state[this.index];
    this.index += 1;
    y ^= y >>> 11;
    y ^= (y << 7) & 0x9d2c5680;
    y ^= (y << 15) & 0xefc60000;
    y ^= y >>> 18;
    return y >>> 0;
  }

  /**
   * The next double in [0, 1) from two outputs, 53 bits (numpy's random_sample, np.random.rand).
   *
   * @returns {number} The double.
   */
  nextDouble() {
    const a = this.nextUint32() >>> 5;
    const b = this.nextUint32() >>> 6;
    return (a * 67108864 + b) / 9007199254740992;
  }
}

/**
 * A seed's bytes folded to 32 bits: the XOR of its little-endian 32-bit words.
 *
 * @param {Uint8Array} seed The seed (a multiple of 4 bytes).
 * @returns {number} The 32-bit seed.
 */
export function foldSeed(seed) {
  if (seed.length % 4 !== 0) throw new Error(`expected a mask seed of a multiple of 4 bytes, but got ` +
    `${seed.length} bytes; pass the 32-byte private seed or a 44-byte shared key`);
  const view = new DataView(seed.buffer, seed.byteOffset, seed.byteLength);
  let folded = 0;
  for (let i = 0; i < seed.length; i += 4) folded ^= view.getUint32(i, true);
  return folded >>> 0;
}

/**
 * The masks Flower's pseudo_rand_gen draws for a seed: one array of integers in [0, numRange - 2] per shape.
 *
 * @param {Uint8Array} seed The seed's bytes.
 * @param {number} numRange The modulus (SecAgg+'s mod_range); at most 2^32 + 1 here.
 * @param {Array<Array<number>>} shapes The arrays' shapes ([] for a scalar).
 * @returns {Array<Float64Array>} The masks, flat, in C order (integers held exactly as doubles).
 */
export function maskArrays(seed, numRange, shapes) {
  const span = numRange - 2;
  if (!(Number.isSafeInteger(numRange) && span >= 0 && span <= 0xffffffff)) {
    throw new Error(`expected a mod_range from 2 to 2^32 + 1 (the 32-bit draws numpy makes for it), but got ` +
      `${numRange}; keep Flower's default modulus 2^32`);
  }
  const generator = new MT19937(foldSeed(seed));
  let mask = span;
  for (let shift = 1; shift <= 16; shift *= 2) mask |= mask >>> shift;
  mask >>>= 0;
  return shapes.map((shape) => {
    const out = new Float64Array(shape.reduce((n, d) => n * d, 1));
    for (let i = 0; i < out.length; i += 1) {
      let value;
      if (span === 0) value = 0;
      else if (span === 0xffffffff) value = generator.nextUint32();
      else do value = (generator.nextUint32() & mask) >>> 0; while (value > span);
      out[i] = value;
    }
    return out;
  });
}

/**
 * Flower's quantize of one array: clipped, shifted and scaled to [0, targetRange], stochastically rounded.
 *
 * @param {Float32Array|Float64Array} values The array (its type is the arithmetic's, as in numpy).
 * @param {number} clippingRange The clipping range.
 * @param {number} targetRange The quantization range.
 * @param {function(): number} uniform Doubles in [0, 1), one a value (np.random.rand's draws).
 * @returns {Int32Array} The quantized values.
 */
export function quantize(values, clippingRange, targetRange, uniform) {
  const round = values instanceof Float32Array ? Math.fround : (x) => x;
  const quantizer = round(targetRange / (2 * clippingRange));
  const high = round(clippingRange);
  const out = new Int32Array(values.length);
  for (let i = 0; i < values.length; i += 1) {
    const clipped = Math.min(Math.max(values[i], -high), high);
    const scaled = round(round(clipped + high) * quantizer);
    const up = Math.ceil(scaled);
    out[i] = uniform() < up - scaled ? up - 1 : up;
  }
  return out;
}

/**
 * Flower's dequantize of one array: back to [-clippingRange, clippingRange], in float64.
 *
 * @param {ArrayLike<number>} values The quantized values.
 * @param {number} clippingRange The clipping range.
 * @param {number} targetRange The quantization range.
 * @returns {Float64Array} The values.
 */
export function dequantize(values, clippingRange, targetRange) {
  const quantizer = (2 * clippingRange) / targetRange;
  return Float64Array.from(values, (v) => v * quantizer - clippingRange);
}

/**
 * numpy's .npy bytes of an int64 array, as Flower's ndarray_to_bytes (np.save) writes them.
 *
 * @param {ArrayLike<number>} values The integers (safe integers), flat in C order.
 * @param {Array<number>} shape The shape ([] for a scalar).
 * @returns {Uint8Array} The .npy file's bytes (format 1.0).
 */
export function int64Npy(values, shape) {
  const dims = shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(', ')})`;
  let header = `{'descr': '<i8', 'fortran_order': False, 'shape': ${dims}, }`;
  // NOTE: numpy leaves room for the first axis to grow to 21 digits, then pads to a multiple of 64 bytes.
  if (shape.length > 0) header += ' '.repeat(21 - String(shape[0]).length);
  header += ' '.repeat(64 - ((10 + header.length + 1) % 64)) + '\n';
  const out = new Uint8Array(10 + header.length + 8 * values.length);
  out.set([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 1, 0]);
  const view = new DataView(out.buffer);
  view.setUint16(8, header.length, true);
  out.set(new TextEncoder().encode(header), 10);
  for (let i = 0, at = 10 + header.length; i < values.length; i += 1, at += 8) {
    // NOTE: two 32-bit halves (ToUint32 keeps the low word, two's complement included): a BigInt a value was slower.
    view.setUint32(at, values[i] >>> 0, true);
    view.setInt32(at + 4, Math.floor(values[i] / 4294967296), true);
  }
  return out;
}
