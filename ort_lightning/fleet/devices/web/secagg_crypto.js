// SecAgg+'s cryptography on WebCrypto, as Flower 1.42.0's Python writes it (tests/web/secagg_vectors.json pins it):
//
// - key pairs: ECDH on P-384, private keys as PEM PKCS#8, public keys as PEM SubjectPublicKeyInfo
//   (flwr.supercore.primitives.asymmetric: private_key_to_bytes, public_key_to_bytes);
// - the shared key: the ECDH secret through HKDF-SHA256 (no salt, no info) to 32 bytes, base64url-encoded
//   (flwr.common.secure_aggregation.crypto.symmetric_encryption.generate_shared_key), which is a Fernet key;
// - Fernet: 0x80 | big-endian uint64 seconds | 16-byte IV | AES-128-CBC (PKCS#7) | HMAC-SHA256 of all that,
//   base64url with padding; the key's first 16 bytes sign, the last 16 encrypt.

const subtle = globalThis.crypto.subtle;
const CURVE = {name: 'ECDH', namedCurve: 'P-384'};
const FERNET_VERSION = 0x80;

/**
 * Bytes as base64, standard or URL-safe, with padding (Python's b64encode, urlsafe_b64encode).
 *
 * @param {Uint8Array} bytes The bytes.
 * @param {boolean} [urlSafe] '-' and '_' for '+' and '/'.
 * @returns {string} The text.
 */
export function toBase64(bytes, urlSafe = false) {
  let binary = '';
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  const text = btoa(binary);
  return urlSafe ? text.replaceAll('+', '-').replaceAll('/', '_') : text;
}

/**
 * Base64 (standard or URL-safe, padded or not) as bytes.
 *
 * @param {string} text The text.
 * @returns {Uint8Array} The bytes.
 */
export function fromBase64(text) {
  const standard = text.trim().replaceAll('-', '+').replaceAll('_', '/');
  const binary = atob(standard + '='.repeat((4 - (standard.length % 4)) % 4));
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

/**
 * Concatenates byte arrays.
 *
 * @param {Array<Uint8Array>} parts The parts.
 * @returns {Uint8Array} One array.
 */
export function concatBytes(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}

/**
 * DER as PEM, as OpenSSL (and so Python's cryptography) writes it: 64 characters a line, a final newline.
 *
 * @param {ArrayBuffer} der The DER bytes.
 * @param {string} label 'PUBLIC KEY' or 'PRIVATE KEY'.
 * @returns {Uint8Array} The PEM text's ASCII bytes.
 */
function toPem(der, label) {
  const lines = toBase64(new Uint8Array(der)).match(/.{1,64}/g);
  return new TextEncoder().encode(`-----BEGIN ${label}-----\n${lines.join('\n')}\n-----END ${label}-----\n`);
}

/**
 * PEM bytes as DER.
 *
 * @param {Uint8Array} pem The PEM text's bytes.
 * @param {string} label The expected label.
 * @returns {Uint8Array} The DER bytes.
 */
function fromPem(pem, label) {
  const text = new TextDecoder().decode(pem);
  const match = text.match(new RegExp(`-----BEGIN ${label}-----([^-]+)-----END ${label}-----`));
  if (!match) throw new Error(`expected a PEM ${label} (as Flower's ${label === 'PUBLIC KEY' ? 'public' : 'private'}` +
    `_key_to_bytes writes it), but got ${JSON.stringify(text.slice(0, 40))}; pass the bytes a SecAgg+ peer sent`);
  return fromBase64(match[1].replace(/\s+/g, ''));
}

/**
 * A new P-384 key pair, as SecAgg+'s setup stage makes two.
 *
 * @returns {Promise<{privateKey: CryptoKey, publicKey: CryptoKey}>} An extractable ECDH pair.
 */
export function generateKeyPair() {
  return subtle.generateKey(CURVE, true, ['deriveBits']);
}

/**
 * A private key as Flower's private_key_to_bytes writes one (PEM, PKCS#8, unencrypted).
 *
 * @param {CryptoKey} key An extractable ECDH private key.
 * @returns {Promise<Uint8Array>} The PEM bytes.
 */
export async function privateKeyToBytes(key) {
  return toPem(await subtle.exportKey('pkcs8', key), 'PRIVATE KEY');
}

/**
 * A public key as Flower's public_key_to_bytes writes one (PEM SubjectPublicKeyInfo, uncompressed point).
 *
 * @param {CryptoKey} key An ECDH public key.
 * @returns {Promise<Uint8Array>} The PEM bytes.
 */
export async function publicKeyToBytes(key) {
  return toPem(await subtle.exportKey('spki', key), 'PUBLIC KEY');
}

/**
 * Reads a private key that Flower's private_key_to_bytes wrote.
 *
 * @param {Uint8Array} pem PEM PKCS#8 bytes.
 * @returns {Promise<CryptoKey>} The ECDH private key.
 */
export async function bytesToPrivateKey(pem) {
  return subtle.importKey('pkcs8', fromPem(pem, 'PRIVATE KEY'), CURVE, true, ['deriveBits']);
}

/**
 * Reads a public key that Flower's public_key_to_bytes wrote.
 *
 * @param {Uint8Array} pem PEM SubjectPublicKeyInfo bytes.
 * @returns {Promise<CryptoKey>} The ECDH public key.
 */
export async function bytesToPublicKey(pem) {
  return subtle.importKey('spki', fromPem(pem, 'PUBLIC KEY'), CURVE, true, []);
}

/**
 * The public key of a private key (WebCrypto keeps it in the JWK form).
 *
 * @param {CryptoKey} privateKey An extractable ECDH private key.
 * @returns {Promise<CryptoKey>} Its public key.
 */
export async function publicKeyOf(privateKey) {
  const {kty, crv, x, y} = await subtle.exportKey('jwk', privateKey);
  return subtle.importKey('jwk', {kty, crv, x, y}, CURVE, true, []);
}

/**
 * Flower's generate_shared_key: ECDH, then HKDF-SHA256 to 32 bytes, base64url-encoded (a Fernet key).
 *
 * @param {CryptoKey} privateKey This side's private key.
 * @param {CryptoKey} publicKey The other side's public key.
 * @returns {Promise<Uint8Array>} The key's 44 ASCII bytes, as Flower returns them.
 */
export async function generateSharedKey(privateKey, publicKey) {
  const secret = await subtle.deriveBits({name: 'ECDH', public: publicKey}, privateKey, 384);
  const material = await subtle.importKey('raw', secret, 'HKDF', false, ['deriveBits']);
  // NOTE: HKDF without a salt uses a hash-length run of zeros (RFC 5869), as cryptography's HKDF(salt=None) does.
  const derived = await subtle.deriveBits(
    {name: 'HKDF', hash: 'SHA-256', salt: new Uint8Array(32), info: new Uint8Array(0)}, material, 256);
  return new TextEncoder().encode(toBase64(new Uint8Array(derived), true));
}

/**
 * The signing and encryption keys of a Fernet key.
 *
 * @param {Uint8Array} key The Fernet key (44 base64url ASCII bytes).
 * @returns {Promise<{sign: CryptoKey, aes: CryptoKey}>} HMAC-SHA256 and AES-CBC keys.
 */
async function fernetKeys(key) {
  const raw = fromBase64(new TextDecoder().decode(key));
  if (raw.length !== 32) throw new Error(`expected a Fernet key of 32 bytes (44 base64url characters), but got ` +
    `${raw.length} bytes; pass the key generateSharedKey returns`);
  const sign = await subtle.importKey('raw', raw.subarray(0, 16), {name: 'HMAC', hash: 'SHA-256'}, false,
    ['sign', 'verify']);
  const aes = await subtle.importKey('raw', raw.subarray(16), 'AES-CBC', false, ['encrypt', 'decrypt']);
  return {sign, aes};
}

/**
 * Flower's encrypt: a Fernet token of the plaintext.
 *
 * @param {Uint8Array} key The Fernet key (44 base64url ASCII bytes).
 * @param {Uint8Array} plaintext The bytes to encrypt.
 * @param {{iv?: Uint8Array, time?: number}} [parts] A fixed IV and time (seconds), for tests; random and now by default.
 * @returns {Promise<Uint8Array>} The token's ASCII bytes.
 */
export async function encrypt(key, plaintext, {iv, time} = {}) {
  const {sign, aes} = await fernetKeys(key);
  const vector = iv ?? globalThis.crypto.getRandomValues(new Uint8Array(16));
  const seconds = BigInt(time ?? Math.floor(Date.now() / 1000));
  const head = new Uint8Array(25);
  head[0] = FERNET_VERSION;
  new DataView(head.buffer).setBigUint64(1, seconds, false);
  head.set(vector, 9);
  const ciphertext = new Uint8Array(await subtle.encrypt({name: 'AES-CBC', iv: vector}, aes, plaintext));
  const signed = concatBytes([head, ciphertext]);
  const mac = new Uint8Array(await subtle.sign('HMAC', sign, signed));
  return new TextEncoder().encode(toBase64(concatBytes([signed, mac]), true));
}

/**
 * Flower's decrypt: the plaintext of a Fernet token, its HMAC checked (no time-to-live, as Flower calls it).
 *
 * @param {Uint8Array} key The Fernet key (44 base64url ASCII bytes).
 * @param {Uint8Array} token The token's ASCII bytes.
 * @returns {Promise<Uint8Array>} The plaintext.
 */
export async function decrypt(key, token) {
  const {sign, aes} = await fernetKeys(key);
  const data = fromBase64(new TextDecoder().decode(token));
  if (data.length < 57 || data[0] !== FERNET_VERSION || (data.length - 57) % 16 !== 0) {
    throw new Error(`expected a Fernet token (version 0x80, then time, IV, AES blocks and HMAC), but got ` +
      `${data.length} bytes starting 0x${(data[0] ?? 0).toString(16)}; the ciphertext is not a SecAgg+ share`);
  }
  const signed = data.subarray(0, data.length - 32);
  if (!(await subtle.verify('HMAC', sign, data.subarray(data.length - 32), signed))) {
    throw new Error('the Fernet token\'s HMAC does not match its key: the share was encrypted for another ' +
      'node or altered on the way; the round cannot use it');
  }
  const plaintext = await subtle.decrypt({name: 'AES-CBC', iv: data.subarray(9, 25)}, aes, data.subarray(25, -32));
  return new Uint8Array(plaintext);
}
