"""The fleet experiment people run: N devices, R rounds of a Flower strategy, accuracy per round.

`run_experiment` trains the artifacts on `devices` devices for `rounds` rounds, prints the global
accuracy after each round, and writes each round's ORT checkpoint, ``history.json`` and (with
matplotlib) ``accuracy.png`` under `out`. The data is an argument: ``data(partition, partitions)
-> ClientData`` for the devices (the contract of `DeviceClient`) and ``test``, the batches the
global model is evaluated on; ``ort-lightning fleet`` passes the digits (`ort_lightning.fleet.data.digits`),
the example's data set.

Every engine's devices run `DeviceClient` on the device folder ``out/device`` that
`prepare_for_web` writes from the artifacts (its optimizer graph computes the config's ``lr``),
the very files a browser loads: ``runner: ort`` runs ONNX Runtime's loop, what a real device
runs, so that a simulated round equals a browser's round; ``runner: lightning`` runs a
``lightning.Trainer`` over an `ORTLightningModule` at the folder's rate instead.

``engine: local`` runs Flower's apps in this process (`run_local`: exact and fast on a few
cores); ``engine: simulation`` runs them on Flower's Ray simulation engine, the one that scales
to many machines; ``engine: browser`` serves a page whose visitors are the devices
(`ort_lightning.fleet.engines.browser`: ``host``, ``port``, ``device_timeout``, ``ort_web``).

Example::

    >>> config = FleetConfig.from_dict({"devices": 3, "rounds": 1, "out": "runs/fleet"})
    >>> config.devices, config.strategy, config.split
    (3, 'fedavg', 'iid')
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import ENGINES, STRATEGIES, FleetConfig
from ort_lightning.fleet.devices.client import DeviceClient
from ort_lightning.fleet.devices.protocol import RUNNERS, DataFn
from ort_lightning.fleet.engines.browser.browser_run import run_browser_experiment
from ort_lightning.fleet.engines.local import run_local
from ort_lightning.fleet.server.assembly import device_folder, fleet_server, quiet_ray
from ort_lightning.fleet.server.report import report
from ort_lightning.fleet.server.server_app import FleetServer

__all__ = ["ENGINES", "RUNNERS", "STRATEGIES", "FleetConfig", "run_experiment"]


def _run(server: FleetServer, client: DeviceClient, config: FleetConfig) -> None:
    if config.engine == "local":
        run_local(server.server_app(), client.client_app(), nodes=config.devices)
        return
    from flwr.simulation import run_simulation

    quiet_ray()
    # NOTE: the actors' own log lines (Flower's "Manually terminating ClientAppActor" at the end of each run) stay in
    # the actors: a device's failure reaches the server as its error reply, which the round line names.
    backend: dict[str, Any] = {"client_resources": {"num_cpus": config.cpus_per_device, "num_gpus": 0.0},
                               "init_args": {"log_to_driver": False}}
    run_simulation(server.server_app(), client.client_app(), num_supernodes=config.devices, backend_config=backend)


def run_experiment(
    config: FleetConfig,
    artifacts: str | os.PathLike[str],
    data: DataFn | None,
    *,
    test: DataLoader | None = None,
    echo: bool = True,
) -> FleetServer:
    """Run the experiment; print accuracy per round (when `echo`); write history.json and accuracy.png.

    Args:
        config: the experiment.
        artifacts: the exported artifacts (the server's folder; the devices' folder is written from it).
        data: ``(partition, partitions) -> ClientData``, each device's data (as `DeviceClient` takes it);
            None only with ``engine: browser`` and ``page_data`` (the pages make their own).
        test: the batches the global model is evaluated on after every round (None: no accuracy).
        echo: print the accuracy per round.

    Returns:
        The `FleetServer`, whose ``history`` holds each round's record.

    Raises:
        ConfigurationError: without `data` where the devices need it.
    """
    Path(config.out).mkdir(parents=True, exist_ok=True)
    if config.engine == "browser":
        return run_browser_experiment(config, artifacts, data, test=test, echo=echo)
    if data is None:
        raise ConfigurationError(f"Expected `data`, each device's (partition, partitions) -> ClientData, for engine "
                                 f"{config.engine!r}, but got None; pass the devices' data (only browser pages with "
                                 "page_data make their own).")
    server = fleet_server(config, artifacts, test)
    client = DeviceClient(device_folder(config, artifacts).directory, data, epochs=config.epochs, runner=config.runner,
                          optimizer_state=config.optimizer_state, start=config.start)
    started = time.perf_counter()
    _run(server, client, config)
    report(server, config, time.perf_counter() - started, echo=echo)
    return server
