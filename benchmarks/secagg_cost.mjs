// What SecAgg+ costs one JavaScript device (python -m benchmarks.secagg runs this in Node and in a Chromium page).
//
// For each update size, `devices` SecAggPlusClients run a round in this one thread, every device a neighbour of
// every other (share_num = devices); one device's stages are timed, by the wall clock, median of `repeats` rounds:
// setup (two P-384 key pairs), share keys (Shamir shares of the seed and key, one ECDH + Fernet per neighbour),
// collect masked vectors (decrypt the shares, weight, quantize, the private mask and one pairwise mask per
// neighbour, mod, .npy) and unmask; then the bytes that device sends beside and instead of its float32 update.
// Only web APIs: the same module runs in both places.

const web = (name) => new URL(`../ort_lightning/fleet/devices/web/${name}`, import.meta.url).href;
const { SecAggPlusClient } = await import(web('secagg.js'));

const ROUND = {clipping_range: 8.0, target_range: 2 ** 22, mod_range: 2 ** 32, max_weight: 1000.0};

/**
 * Times an async call.
 *
 * @param {function(): Promise<*>} call The call.
 * @returns {Promise<[number, *]>} Milliseconds and its result.
 */
async function timed(call) {
  const start = performance.now();
  const result = await call();
  return [performance.now() - start, result];
}

/**
 * One round of `devices` clients over an update of `size` values; the first device's times and bytes.
 *
 * @param {number} size The update's values.
 * @param {number} devices The devices (all neighbours).
 * @returns {Promise<object>} Milliseconds per stage and bytes sent.
 */
async function round(size, devices) {
  const ids = Array.from({length: devices}, (_, i) => BigInt(i + 1));
  const clients = ids.map((nodeId) => new SecAggPlusClient({nodeId}));
  const configs = {...ROUND, sample_num: devices, share_num: devices, threshold: Math.floor(devices / 2) + 1};
  const times = {};
  const keys = [];
  let shared = [];
  for (const [i, client] of clients.entries()) {
    const [ms, {pk1, pk2}] = await timed(() => client.setup(configs));
    if (i === 0) times.setup = ms;
    keys.push([ids[i], [pk1, pk2]]);
  }
  const inbox = new Map(ids.map((id) => [id, {srcs: [], ctxts: []}]));
  for (const [i, client] of clients.entries()) {
    const [ms, {dsts, ctxts}] = await timed(() => client.shareKeys(keys));
    if (i === 0) [times.share_keys, shared] = [ms, ctxts];
    dsts.forEach((dst, j) => {
      inbox.get(dst).srcs.push(ids[i]);
      inbox.get(dst).ctxts.push(ctxts[j]);
    });
  }
  const values = Float32Array.from({length: size}, (_, i) => Math.sin(i) * 0.1);
  const [collectMs, {masked_params: masked}] = await timed(() => clients[0].collectMaskedVectors(inbox.get(ids[0]),
    {numExamples: 30, arrays: [{values, shape: [size]}]}));
  times.collect = collectMs;
  const [unmaskMs, {shares}] = await timed(async () => clients[0].unmask({active_nids: ids, dead_nids: []}));
  times.unmask = unmaskMs;
  const sum = (list) => list.reduce((n, b) => n + b.length, 0);
  const sent = {
    keys: sum(keys[0][1]), shares: sum(shared), masked: sum(masked), plain: 4 * size, unmask: sum(shares),
  };
  return {times, sent};
}

/**
 * The cost table's rows.
 *
 * @param {{sizes?: Array<number>, devices?: number, repeats?: number}} [options] Update sizes, devices, rounds each.
 * @returns {Promise<Array<object>>} Per size: the median milliseconds per stage and the bytes sent.
 */
export async function measure({sizes = [1e4, 1e5, 1e6], devices = 5, repeats = 3} = {}) {
  const rows = [];
  for (const size of sizes) {
    const runs = [];
    for (let r = 0; r < repeats; r += 1) runs.push(await round(size, devices));
    const median = (key) => runs.map((run) => run.times[key]).sort((a, b) => a - b)[Math.floor(repeats / 2)];
    rows.push({size, devices, setup: median('setup'), share_keys: median('share_keys'), collect: median('collect'),
      unmask: median('unmask'), sent: runs[0].sent});
  }
  return rows;
}

if (typeof window === 'undefined') {
  const [sizes, devices, repeats] = [globalThis.process.argv[2], globalThis.process.argv[3], globalThis.process.argv[4]];
  console.log(JSON.stringify(await measure({sizes: sizes ? sizes.split(',').map(Number) : undefined,
    devices: devices ? Number(devices) : undefined, repeats: repeats ? Number(repeats) : undefined})));
}
