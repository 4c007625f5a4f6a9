// Shamir's secret sharing as Flower 1.42.0 does it (flwr.common.secure_aggregation.crypto.shamir), which is
// PyCryptodome's Shamir (Crypto.Protocol.SecretSharing, ssss=False) over 16-byte chunks:
//
// - the secret is PKCS#7-padded to a multiple of 16 bytes and cut into 16-byte chunks;
// - each chunk is the constant term of a polynomial over GF(2^128) (x^128 + x^7 + x^2 + x + 1, an element read
//   big-endian, bit 0 the constant coefficient) whose k - 1 other coefficients are random 16-byte strings,
//   drawn highest degree first, and evaluated by Horner's method at x = 1 .. n;
// - share i is the uint32 little-endian index i, then chunk by chunk the 16-byte value at i.

const IRREDUCIBLE = (1n << 128n) | 0x87n;
const TOP = 1n << 128n;

/**
 * 16 bytes, big-endian, as a field element.
 *
 * @param {Uint8Array} bytes 16 bytes.
 * @returns {bigint} The element.
 */
function toElement(bytes) {
  let value = 0n;
  for (const byte of bytes) value = (value << 8n) | BigInt(byte);
  return value;
}

/**
 * A field element as 16 bytes, big-endian.
 *
 * @param {bigint} value The element.
 * @returns {Uint8Array} 16 bytes.
 */
function fromElement(value) {
  const out = new Uint8Array(16);
  for (let i = 15; i >= 0; i -= 1) {
    out[i] = Number(value & 0xffn);
    value >>= 8n;
  }
  return out;
}

/**
 * The product of two elements of GF(2^128), looping over the smaller one's bits (share indices are small).
 *
 * @param {bigint} a An element.
 * @param {bigint} b An element.
 * @returns {bigint} a * b.
 */
function multiply(a, b) {
  let [v, f] = a > b ? [a, b] : [b, a];
  let z = 0n;
  while (f) {
    if (f & 1n) z ^= v;
    v <<= 1n;
    if (v & TOP) v ^= IRREDUCIBLE;
    f >>= 1n;
  }
  return z;
}

/**
 * The inverse of a nonzero element: a^(2^128 - 2).
 *
 * @param {bigint} a The element.
 * @returns {bigint} 1 / a.
 */
function inverse(a) {
  let result = 1n;
  let square = a;
  for (let bit = 1; bit < 128; bit += 1) {
    square = multiply(square, square);
    result = multiply(result, square);
  }
  return result;
}

/**
 * The secret PKCS#7-padded to whole 16-byte blocks (a full block when it is already whole), as PyCryptodome's pad.
 *
 * @param {Uint8Array} secret The secret.
 * @returns {Uint8Array} The padded bytes.
 */
function pad(secret) {
  const count = 16 - (secret.length % 16);
  const out = new Uint8Array(secret.length + count).fill(count);
  out.set(secret);
  return out;
}

/**
 * Flower's create_shares: n shares of a secret, any k of which give it back.
 *
 * @param {Uint8Array} secret The secret (any length).
 * @param {number} threshold k, the shares needed.
 * @param {number} count n, the shares made.
 * @param {function(number): Uint8Array} [randomBytes] The coefficients' source (crypto.getRandomValues by default).
 * @returns {Array<Uint8Array>} The shares, share i + 1 at index i.
 */
export function createShares(secret, threshold, count, randomBytes = randomBytesOf) {
  if (!(threshold >= 1 && count >= threshold && count < 2 ** 32)) {
    throw new Error(`expected 1 <= threshold <= count < 2^32 shares, but got threshold ${threshold} and count ` +
      `${count}; pass SecAgg+'s reconstruction threshold and its number of shares`);
  }
  const padded = pad(secret);
  const shares = Array.from({length: count}, (_, index) => {
    const share = new Uint8Array(4 + padded.length);
    new DataView(share.buffer).setUint32(0, index + 1, true);
    return share;
  });
  for (let start = 0; start < padded.length; start += 16) {
    const coefficients = Array.from({length: threshold - 1}, () => toElement(randomBytes(16)));
    coefficients.push(toElement(padded.subarray(start, start + 16)));
    shares.forEach((share, index) => {
      const x = BigInt(index + 1);
      let y = 0n;
      for (const c of coefficients) y = multiply(x, y) ^ c;
      share.set(fromElement(y), 4 + start);
    });
  }
  return shares;
}

/**
 * Flower's combine_shares: the secret from exactly the threshold's number of shares.
 *
 * @param {Array<Uint8Array>} shares The shares (each the index, then 16 bytes a chunk).
 * @returns {Uint8Array} The secret.
 */
export function combineShares(shares) {
  const points = shares.map((share) => BigInt(new DataView(share.buffer, share.byteOffset).getUint32(0, true)));
  if (new Set(points).size !== points.length) throw new Error('Duplicate share: each share index may appear once');
  const padded = new Uint8Array(shares[0].length - 4);
  for (let start = 0; start < padded.length; start += 16) {
    let secret = 0n;
    points.forEach((xj, j) => {
      let numerator = 1n;
      let denominator = 1n;
      points.forEach((xm, m) => {
        if (m === j) return;
        numerator = multiply(numerator, xm);
        denominator = multiply(denominator, xj ^ xm);
      });
      const yj = toElement(shares[j].subarray(4 + start, 4 + start + 16));
      secret ^= multiply(multiply(yj, numerator), inverse(denominator));
    });
    padded.set(fromElement(secret), start);
  }
  const count = padded.at(-1);
  if (!(count >= 1 && count <= 16) || padded.subarray(padded.length - count).some((b) => b !== count)) {
    throw new Error('Failed to combine shares: the padding is wrong, so the shares are not of one secret');
  }
  return padded.slice(0, padded.length - count);
}

/**
 * Random bytes from WebCrypto.
 *
 * @param {number} size How many.
 * @returns {Uint8Array} The bytes.
 */
export function randomBytesOf(size) {
  return globalThis.crypto.getRandomValues(new Uint8Array(size));
}
