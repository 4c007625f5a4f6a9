"""Browsers as the devices of a fleet: a web server whose visitors train the artifacts in WebAssembly.

`BrowserFleet` serves one page on an address you choose (loopback by default). Every browser
that opens its URL (``http://HOST:PORT/?token=...``, printed with a random join token; a wrong
token is refused) becomes one Flower device, partition ``i`` of ``devices`` in joining order.
The page (``page.html``, ``page.js`` and ``device.js`` in ``ort_lightning/fleet/devices/web``) imports
onnxruntime-web's training build (served from ``npm install onnxruntime-web@1.19.2``'s ``dist/``
folder, or from a URL you give), loads the device folder's graphs and checkpoint, and trains every round it is sent with
``runner.js``. Flower's own machinery runs the rounds: `FleetServer` with its strategy and its
checkpoint per round, over `BrowserGrid`, whose nodes are the connected browsers.

A round, for each browser: the server sends the round's weights (flat float32 in the order of
ONNX Runtime's parameter buffer, the training graph's order of its state inputs, checked against
ORT when the fleet starts; the ``welcome`` names it) and the browser's batches for each local
epoch; the page trains them on a fresh onnxruntime-web session (one train step, optimizer step
and gradient reset per batch) and sends back its weights, the example count of one epoch and the
losses. Before a reply reaches the strategy it is checked: as many float32 values as the model
has, all finite, a frame under the size limit, an example count from 1 to what the browser was
given. A browser that fails a check, closes its tab, or does not answer within
``device_timeout`` is dropped and named (the log, `BrowserFleet.refusals`); the round completes
with the other browsers.

Data, the contract of ``data(partition, partitions) -> ClientData`` (the one `DeviceClient`
takes): the server calls it for a device's partition every round and iterates
``ClientData.train`` once per local epoch, in this process; each batch is a tuple of tensors in
the training graph's input order (model inputs, then labels) or a dict keyed by input name,
with dtypes float32, int64, int32 or bool. The batches travel to the page, so a browser fleet
trains exactly the batches a simulated fleet with the same ``data`` trains, in the same order.
`ClientData.test` is not used: the server evaluates the global model (``FleetServer(test=...)``).

Data made on the device, the contract of ``page_data`` (``BrowserFleet(folder, page_data="my_data.js",
max_examples=N)``, instead of ``data``): an ES module, served to the pages with the join token at
``/data.js``, which every page imports once it has loaded the device files, and which exports::

    export async function batches({partition, partitions, round, epoch, inputNames}) { ... }

The page calls it once per local epoch of every round, with its partition (``0 <= partition <
partitions``, ``partitions`` the fleet's ``devices``), the server's round (from 1) and the epoch
(from 0), and ``inputNames``, the training graph's inputs in order (model inputs, then labels).
It returns (or resolves to) a non-empty ``Array`` of batches; a batch is an ``Array`` with one
tensor per input name, in that order; a tensor is ``{type, data, dims}`` with ``type`` one of
``'float32'``, ``'int64'``, ``'int32'``, ``'bool'`` and ``data`` a ``Float32Array``,
``BigInt64Array``, ``Int32Array`` or ``Uint8Array`` of ``dims``' product of values. The device
trains each batch once per epoch (one train step, optimizer step and gradient reset) and claims
the last epoch's example count, the sum of each batch's first dimension: FedAvg's weight. The
server sends only the weights; since it cannot count what a page made, it refuses a device whose
claim is not from 1 to ``max_examples``. A module that exports no ``batches``, or a call that
throws or returns no batches, fails that device (its page shows why); the module runs with the
page's rights and sees nothing of the server but these arguments. ``examples/browser_data.js``
makes a seeded toy set (mulberry32, seed ``1000 + partition``) in about 50 lines.

What a browser cannot do, and how the fleet covers it: onnxruntime-web cannot set a learning
rate (a folder from ``prepare_for_web`` computes its own in the optimizer graph; a plain folder
trains at ORT's default 1e-3) nor save a checkpoint (only the weights come back, so each round
starts the device's optimizer anew, as ``DeviceClient(optimizer_state="fresh")`` does; the server
writes the complete ORT checkpoint of each round).

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts
    >>> from ort_lightning.fleet.data.digits import DigitsPartitions
    >>> artifacts = export_artifacts(torch.nn.Linear(64, 10), torch.zeros(2, 64), tempfile.mkdtemp(),
    ...                              nominal_checkpoint=True, verify=False)
    >>> fleet = BrowserFleet(artifacts, DigitsPartitions(), port=0, devices=2,
    ...                      ort_web="https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist")
    >>> fleet.url.startswith("http://127.0.0.1:"), fleet.hub.parameters
    (True, 650)
    >>> fleet.close()
"""

from __future__ import annotations

from ort_lightning.fleet.engines.browser.browser_fleet import BrowserFleet
from ort_lightning.fleet.engines.browser.grid import BrowserGrid
from ort_lightning.fleet.engines.browser.hub import BrowserDevice, Refusal

__all__ = ["BrowserDevice", "BrowserFleet", "BrowserGrid", "Refusal"]
