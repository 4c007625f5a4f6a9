// A browser fleet's data module: each page makes its own partition, so the data never leaves it.
//
//   fleet = BrowserFleet(device_folder, page_data="examples/browser_data.js", max_examples=64, devices=2)
//
// The page imports this file and, each round, calls `batches` once per local epoch with
// {partition, partitions, round, epoch, inputNames}; it returns one epoch's batches, each an Array
// of tensors in the order of `inputNames` (the training graph's inputs: model inputs, then labels),
// a tensor being {type: 'float32' | 'int64' | 'int32' | 'bool', data: TypedArray, dims: number[]}
// with int64 data as a BigInt64Array. The example count of one epoch (the sum of each batch's first
// dimension) is what FedAvg weighs the device's weights by; it must stay within the fleet's
// max_examples.
//
// Here: a toy two-class problem, 4 features in [-1, 1) from a seeded mulberry32 generator (seed
// 1000 + partition), label 1 where x . [1, -2, 0.5, 1.5] > 0, so linearly separable. Partition p
// holds 24 + 8 p examples in batches of 8, the same every round and epoch (use `epoch` to shuffle).

export const FEATURES = 4;
export const BATCH_SIZE = 8;
const DIRECTION = [1, -2, 0.5, 1.5];

/** mulberry32: a 32-bit seeded generator of doubles in [0, 1). */
export function mulberry32(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Partition `partition`'s examples: features (float32, row-major) and labels. */
export function examples(partition) {
  const count = 24 + 8 * partition;
  const random = mulberry32(1000 + partition);
  const x = new Float32Array(count * FEATURES);
  const y = new BigInt64Array(count);
  for (let row = 0; row < count; row += 1) {
    let score = 0;
    for (let column = 0; column < FEATURES; column += 1) {
      x[row * FEATURES + column] = 2 * random() - 1;
      score += x[row * FEATURES + column] * DIRECTION[column];
    }
    y[row] = score > 0 ? 1n : 0n;
  }
  return {x, y, count};
}

/** The fleet's hook: one epoch's batches of this device's partition. */
export async function batches({partition, inputNames}) {
  if (inputNames.length !== 2) {
    throw new Error(`this data module makes (input, labels) batches, but the training graph takes ` +
      `[${inputNames.join(', ')}]; export a model of one ${FEATURES}-feature input with class labels`);
  }
  const {x, y, count} = examples(partition);
  const out = [];
  for (let start = 0; start < count; start += BATCH_SIZE) {
    const end = Math.min(start + BATCH_SIZE, count);
    out.push([
      {type: 'float32', data: x.slice(start * FEATURES, end * FEATURES), dims: [end - start, FEATURES]},
      {type: 'int64', data: y.slice(start, end), dims: [end - start]},
    ]);
  }
  return out;
}
