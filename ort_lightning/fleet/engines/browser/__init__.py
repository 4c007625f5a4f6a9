"""Browsers as the devices of a fleet: a web server whose visitors train the artifacts in WebAssembly.

`BrowserFleet` serves one page; every browser (or Node device) that opens its URL, with the join token,
becomes one Flower node of `BrowserGrid`, and `FleetServer`'s strategy runs the rounds over them. The
contracts of ``data`` and ``page_data``, and what a browser cannot do, are in docs/browsers.md.

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
