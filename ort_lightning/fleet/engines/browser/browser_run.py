"""A fleet experiment with browsers as its devices (``engine: browser``, ``ort-lightning fleet --browsers``).

The browsers load the experiment's device folder (``out/device``, the files a simulated device opens) and
train the partitions a simulated fleet of the same config would (docs/browsers.md).
"""

from __future__ import annotations

import os
import time

from torch.utils.data import DataLoader

from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.devices.protocol import DataFn
from ort_lightning.fleet.engines.browser.browser_fleet import BrowserFleet
from ort_lightning.fleet.server.assembly import device_folder, fleet_server, secure_server
from ort_lightning.fleet.server.report import report
from ort_lightning.fleet.server.secure import SecureFleetServer
from ort_lightning.fleet.server.server_app import FleetServer

__all__ = ["run_browser_experiment"]


def _announce(fleet: BrowserFleet, devices: int) -> None:
    """Print the URL (``on_event`` prints each browser as it joins)."""
    print(f"open this URL in {devices} browsers (tabs or machines that reach this address), one per device:")
    print(f"  {fleet.url}", flush=True)


#: ``device_timeout: null`` in the config: a week, no limit in practice (a finite number, as waits need one).
_NO_LIMIT = 7 * 24 * 3600.0


def run_browser_experiment(
    config: FleetConfig,
    artifacts: str | os.PathLike[str],
    data: DataFn | None,
    *,
    test: DataLoader | None = None,
    echo: bool = True,
) -> FleetServer | SecureFleetServer:
    """Serve the fleet's page, wait for ``devices.count`` browsers, run the rounds; print and write as the others do.

    Args:
        config: the experiment (``engine.name: browser`` and the engine section's page options).
        artifacts: the exported artifacts (the server's folder).
        data: ``(partition, partitions) -> ClientData``, whose batches the server ships to the pages; None
            with ``page_data``.
        test: the batches the global model is evaluated on after every round.
        echo: print the URL, the joins and the accuracy per round.

    Returns:
        The `FleetServer`, whose ``history`` holds each round's record.
    """
    web = device_folder(config, artifacts)
    server = secure_server(config, artifacts, test) if config.secagg.enabled else fleet_server(config, artifacts, test)
    engine, devices = config.engine, config.devices
    shipped = None if engine.page_data else data
    on_event = (lambda event: print(f"  {event.describe()}", flush=True)) if echo else None
    with BrowserFleet(web, shipped, page_data=engine.page_data, max_examples=engine.max_examples, host=engine.host,
                      port=engine.port, devices=devices.count, epochs=devices.epochs,
                      device_timeout=_NO_LIMIT if devices.timeout is None else devices.timeout,
                      ort_web=engine.ort_web, on_event=on_event, min_devices=engine.min_devices,
                      wait_timeout=engine.wait_timeout, certfile=engine.certfile, keyfile=engine.keyfile,
                      token=engine.token) as fleet:
        if echo:
            _announce(fleet, fleet.min_devices)
        started = time.perf_counter()
        fleet.run(server)
        total = time.perf_counter() - started
    # NOTE: each device that failed or left a round was printed as it happened (on_event): one line per event.
    report(server, config, total, echo=echo, engine=f"{devices.count} browsers", departures=False)
    return server
