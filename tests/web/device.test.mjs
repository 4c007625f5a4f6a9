// Unit tests of device.js (FleetDevice, the device's side of the fleet's protocol) with a fake host: a reloaded
// device sends the identity it kept, the server's admission names it, and a round's status is what a page shows.
import assert from 'node:assert/strict';
import { test } from 'node:test';

const { FleetDevice } = await import(new URL('../../ort_lightning/fleet/devices/web/device.js', import.meta.url).href);
const { CLOSE, FINAL_CLOSES } = await import(new URL('../../ort_lightning/web/wire.js', import.meta.url).href);
const RUN_FINISHED = CLOSE.run_finished;
const { pack } = await import(new URL('../../ort_lightning/fleet/devices/web/frames.js', import.meta.url).href);

const WELCOME = JSON.stringify({ type: 'welcome', fleet: 'digits', device: 'browser-1', ort: 'ort.mjs',
  files: { training: 't', eval: 'e', optimizer: 'o', checkpoint: 'c' }, data: null });

/** A host whose runner device adds 1 to every weight per batch; `storage` persists across devices. */
function host(storage) {
  const sent = [];
  const shown = [];
  const openDevice = async () => {
    let weights = null;
    return {
      parameterCount: 3, inputNames: ['input', 'labels'],
      setWeights: async (w) => { weights = Float32Array.from(w); },
      train: async (batches) => {
        weights = weights.map((w) => w + 1);
        return { losses: [0.5], steps: 1, examples: batches[0][0].dims[0] };
      },
      getWeights: async () => weights,
      release: async () => {},
    };
  };
  return { sent, shown, host: { send: (frame) => sent.push(frame), importModule: async () => ({}),
    fetchBytes: async () => new Uint8Array(1), openDevice, show: (status) => shown.push(status), storage } };
}

function memoryStorage() {
  const items = new Map();
  return { getItem: (key) => items.get(key) ?? null, setItem: (key, value) => items.set(key, value) };
}

test('a reloaded device sends the identity it keeps under the fleet\'s name', async () => {
  const storage = memoryStorage();
  const first = host(storage);
  await new FleetDevice(first.host).receive(WELCOME);
  const ready = JSON.parse(first.sent[0]);
  assert.equal(ready.type, 'ready');
  assert.equal(ready.parameters, 3);
  assert.match(ready.identity, /^[0-9a-f]{32}$/);
  assert.equal(storage.getItem('ort-lightning-device:digits'), ready.identity);
  const again = host(storage);
  await new FleetDevice(again.host).receive(WELCOME);
  assert.equal(JSON.parse(again.sent[0]).identity, ready.identity);
  const elsewhere = host(memoryStorage());
  await new FleetDevice(elsewhere.host).receive(WELCOME);
  assert.notEqual(JSON.parse(elsewhere.sent[0]).identity, ready.identity);
});

test('a round shows its epoch and step, then sent, and counts the rounds taken part in', async () => {
  const { host: fake, sent, shown } = host(memoryStorage());
  const device = new FleetDevice(fake);
  await device.receive(WELCOME);
  await device.receive(JSON.stringify({ type: 'admitted', device: 'laptop', partition: 1, partitions: 3 }));
  const tensor = (blob) => ({ type: 'float32', dims: [2, 1], blob });
  const frame = pack({ type: 'train', id: 'm1', round: 4, weights: 0, epochs: [[[tensor(1)], [tensor(1)]]] },
    [new Float32Array([1, 2, 3]), new Float32Array([0, 0])]);
  await device.receive(frame.buffer);
  const phases = shown.map((s) => `${s.phase} ${s.round} ${s.epoch}/${s.epochs} ${s.step}/${s.steps}`);
  assert.ok(phases.includes('training 4 1/1 1/2'), phases.join('; '));
  assert.ok(phases.includes('training 4 1/1 2/2'), phases.join('; '));
  assert.deepEqual({ ...shown.at(-1), loss: undefined }, { fleet: 'digits', device: 'laptop', phase: 'sent', round: 4,
    epoch: 1, epochs: 1, step: 2, steps: 2, loss: undefined, rounds: 1, parameters: 3, message: '', notice: '', partition: 1 });
  const result = sent.at(-1);
  assert.ok(result instanceof Uint8Array);
  const length = new DataView(result.buffer).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(result.slice(4, 4 + length)));
  assert.deepEqual([header.type, header.id, header.round, header.examples, header.steps], ['result', 'm1', 4, 4, 2]);
  await device.receive(JSON.stringify({ type: 'notice', message: 'laptop sent its reply to round 4 after that round had closed' }));
  assert.equal(shown.at(-1).notice, 'laptop sent its reply to round 4 after that round had closed');
  assert.equal(shown.at(-1).phase, 'sent');
});

test('a round that fails becomes an error frame naming the message', async () => {
  const { host: fake, sent } = host(memoryStorage());
  const device = new FleetDevice({ ...fake, openDevice: async () => { throw new Error('no memory'); } });
  const frame = pack({ type: 'train', id: 'm2', round: 1, weights: 0, epochs: [] }, [new Float32Array(3)]);
  await device.receive(frame.buffer);
  assert.deepEqual(JSON.parse(sent.at(-1)), { type: 'error', id: 'm2', message: 'no memory' });
  assert.equal(device.status.phase, 'failed');
});

test('client-side fixed clipping scales the update to the norm, and leaves a smaller one alone', async () => {
  const { clip } = await import(new URL('../../ort_lightning/fleet/devices/web/device.js', import.meta.url).href);
  const sent = new Float32Array([1, 1, 1, 1]);
  const trained = new Float32Array([4, 5, 1, 1]); // the update (3, 4, 0, 0) has norm 5
  assert.equal(clip(trained, sent, 1), 5);
  assert.deepEqual(Array.from(trained, (v) => Math.round(v * 1e6) / 1e6), [1.6, 1.8, 1, 1]);
  const small = new Float32Array([1.3, 1.4, 1, 1]);
  assert.ok(Math.abs(clip(small, sent, 1) - 0.5) < 1e-6);
  assert.deepEqual(small, new Float32Array([1.3, 1.4, 1, 1]));
});

test('the run\'s end is a phase of its own and a final close; a server gone away is neither', () => {
  const { host: fake, shown } = host(memoryStorage());
  const device = new FleetDevice(fake);
  device.closed(1012, 'service restart');
  assert.equal(shown.at(-1).phase, 'disconnected');
  device.closed(RUN_FINISHED, 'the fleet\'s run finished');
  assert.equal(shown.at(-1).phase, 'finished');
  assert.equal(shown.at(-1).message, '4000: the fleet\'s run finished');
  assert.deepEqual([...FINAL_CLOSES].sort(), [1000, 1008, 4000]);
  assert.ok(!FINAL_CLOSES.includes(1012) && !FINAL_CLOSES.includes(1006) && !FINAL_CLOSES.includes(1001));
});

test('a message of a type no handler knows is answered with an error naming the types a device handles', async () => {
  const { host: fake, sent, shown } = host(memoryStorage());
  await new FleetDevice(fake).receive(JSON.stringify({ type: 'kick' }));
  const error = JSON.parse(sent[0]);
  assert.equal(error.type, 'error');
  assert.equal(error.message, 'the server sent a message of type "kick", but a device handles [welcome, admitted, ' +
    'notice, train, secagg]; the server and the page are of different releases');
  assert.equal(shown.at(-1).phase, 'failed');
});
