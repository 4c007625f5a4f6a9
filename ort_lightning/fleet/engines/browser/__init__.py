"""Browsers as the devices of a fleet: a web server whose visitors train the artifacts in WebAssembly.

`BrowserFleet` serves one page; every browser (or Node device) that opens its URL, with the join token,
becomes one Flower node of `BrowserGrid`, and `FleetServer`'s strategy runs the rounds over them. The
contracts of ``data`` and ``page_data``, and what a browser cannot do, are in docs/browsers.md.
"""

from __future__ import annotations

from ort_lightning.fleet.engines.browser.browser_fleet import BrowserFleet
from ort_lightning.fleet.engines.browser.grid import BrowserGrid
from ort_lightning.fleet.engines.browser.hub import BrowserDevice, Refusal

__all__ = ["BrowserDevice", "BrowserFleet", "BrowserGrid", "Refusal"]
