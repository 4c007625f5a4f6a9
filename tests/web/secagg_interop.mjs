// What the JavaScript SecAgg+ client makes with its own randomness, for Flower to read back
// (tests/fleet/devices/test_secagg_interop.py): a fresh key pair and its shared key with a Python key, a Fernet token
// under that key, Shamir shares of a random secret, and the masks of that key. Prints one JSON object.
import { readFile } from 'node:fs/promises';

const web = (name) => new URL(`../../ort_lightning/fleet/devices/web/${name}`, import.meta.url).href;
const crypto = await import(web('secagg_crypto.js'));
const { createShares, randomBytesOf } = await import(web('secagg_shamir.js'));
const { maskArrays } = await import(web('secagg_masks.js'));
const VECTORS = JSON.parse(await readFile(new URL('secagg_vectors.json', import.meta.url), 'utf8'));

const text = (bytes) => new TextDecoder().decode(bytes);
const { privateKey, publicKey } = await crypto.generateKeyPair();
const shared = await crypto.generateSharedKey(privateKey, await crypto.bytesToPublicKey(
  new TextEncoder().encode(VECTORS.keys.b_public)));
const plaintext = randomBytesOf(100);
const secret = randomBytesOf(32);
const privatePem = await crypto.privateKeyToBytes(privateKey);

console.log(JSON.stringify({
  private_key: text(privatePem),
  public_key: text(await crypto.publicKeyToBytes(publicKey)),
  shared_key: text(shared),
  plaintext: crypto.toBase64(plaintext),
  token: text(await crypto.encrypt(shared, plaintext)),
  secret: crypto.toBase64(secret),
  shares: createShares(secret, 3, 5).map((s) => crypto.toBase64(s)),
  key_shares: createShares(privatePem, 2, 3).map((s) => crypto.toBase64(s)),
  masks: Array.from(maskArrays(shared, 2 ** 32, [[100]])[0]),
}));
