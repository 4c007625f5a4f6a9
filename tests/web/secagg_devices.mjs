// JavaScript SecAgg+ devices behind one Node process, for Flower's SecAggPlusWorkflow to talk to
// (tests/fleet/devices/test_secagg_workflow.py). Each stdin line is one message to one device:
//   {"node": "<id>", "stage": "setup" | ..., "configs": [[key, value], ...], "fit": {num_examples, arrays}}
// and each stdout line is the device's reply record. Values are tagged: {"b": base64} bytes, {"i": "<digits>"}
// integers, {"f": x} floats, {"s": text} strings, arrays of tagged values for lists.
import { createInterface } from 'node:readline';

const web = (name) => new URL(`../../ort_lightning/fleet/devices/web/${name}`, import.meta.url).href;
const { fromBase64, toBase64 } = await import(web('secagg_crypto.js'));
const { SecAggPlusClient } = await import(web('secagg.js'));

const decode = (value) => {
  if (Array.isArray(value)) return value.map(decode);
  if ('b' in value) return fromBase64(value.b);
  if ('i' in value) return Number.isSafeInteger(Number(value.i)) ? Number(value.i) : BigInt(value.i);
  return value.f ?? value.s;
};
const encode = (value) => {
  if (Array.isArray(value)) return value.map(encode);
  if (value instanceof Uint8Array) return { b: toBase64(value) };
  return { i: String(value) };
};

const devices = new Map();
const run = async ({ node, stage, configs, fit }) => {
  if (!devices.has(node)) devices.set(node, new SecAggPlusClient({ nodeId: BigInt(node) }));
  const device = devices.get(node);
  const pairs = configs.filter(([key]) => key !== 'stage').map(([key, value]) => [key, decode(value)]);
  const record = Object.fromEntries(pairs);
  if (stage === 'setup') return device.setup(record);
  if (stage === 'share_keys') return device.shareKeys(pairs);
  if (stage === 'collect_masked_vectors') {
    const arrays = fit.arrays.map(({ values, shape }) => ({ values: Float32Array.from(values), shape }));
    return device.collectMaskedVectors(record, { numExamples: fit.num_examples, arrays });
  }
  return device.unmask(record);
};

for await (const line of createInterface({ input: process.stdin })) {
  const reply = await run(JSON.parse(line));
  console.log(JSON.stringify(Object.entries(reply).map(([key, value]) => [key, encode(value)])));
}
