"""The one entry point of a fleet run: sections in, the engine's rounds, the history out (docs/fleets.md).

`run_experiment` is the same run over artifacts and data the caller already holds. Every engine's
devices run `DeviceClient` on the device folder that `prepare_for_web` writes at ``devices.lr``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import ENGINES, STRATEGIES, FleetConfig
from ort_lightning.fleet.data.sources import fleet_data
from ort_lightning.fleet.devices.client import DeviceClient
from ort_lightning.fleet.devices.protocol import RUNNERS, DataFn
from ort_lightning.fleet.engines.browser.browser_run import run_browser_experiment
from ort_lightning.fleet.engines.local import run_local
from ort_lightning.fleet.server.assembly import device_folder, fleet_server, quiet_ray, secure_server
from ort_lightning.fleet.server.model_artifacts import fleet_artifacts
from ort_lightning.fleet.server.pretrained_output import write_last_round
from ort_lightning.fleet.server.report import report
from ort_lightning.fleet.server.secure import SecureFleetServer, secure_mods
from ort_lightning.fleet.server.server_app import FleetServer

__all__ = ["ENGINES", "RUNNERS", "STRATEGIES", "FleetConfig", "run_experiment", "run_fleet"]


def _run(server: FleetServer | SecureFleetServer, client: DeviceClient, config: FleetConfig) -> None:
    if config.engine.name == "local":
        run_local(server.server_app(), client.client_app(), nodes=config.devices.count)
        return
    from flwr.simulation import run_simulation

    quiet_ray()
    # NOTE: the actors' own log lines (Flower's "Manually terminating ClientAppActor" at the end of each run) stay in
    # the actors: a device's failure reaches the server as its error reply, which the round line names.
    backend: dict[str, Any] = {"client_resources": {"num_cpus": config.devices.cpus, "num_gpus": 0.0},
                               "init_args": {"log_to_driver": False}}
    run_simulation(server.server_app(), client.client_app(), num_supernodes=config.devices.count,
                   backend_config=backend)


def run_experiment(
    config: FleetConfig,
    artifacts: str | os.PathLike[str],
    data: DataFn | None,
    *,
    test: DataLoader | None = None,
    echo: bool = True,
) -> FleetServer | SecureFleetServer:
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
    Path(config.output.folder).mkdir(parents=True, exist_ok=True)
    if config.engine.name == "browser":
        return run_browser_experiment(config, artifacts, data, test=test, echo=echo)
    if data is None:
        raise ConfigurationError(f"Expected `data`, each device's (partition, partitions) -> ClientData, for engine "
                                 f"{config.engine.name!r}, but got None; pass the devices' data (only browser pages "
                                 "with page_data make their own).")
    server = secure_server(config, artifacts, test) if config.secagg.enabled else fleet_server(config, artifacts, test)
    devices = config.devices
    client = DeviceClient(device_folder(config, artifacts).directory, data, epochs=devices.epochs,
                          runner=devices.runner, optimizer_state=devices.optimizer_state, start=devices.start,
                          mods=tuple(secure_mods()) if config.secagg.enabled else ())
    started = time.perf_counter()
    _run(server, client, config)
    report(server, config, time.perf_counter() - started, echo=echo)
    return server


def run_fleet(
    config: FleetConfig | Mapping[str, Any],
    *,
    echo: bool = True,
    flower_log: bool = False,
    search: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """Run the fleet a config (or the mapping of its sections) describes; return what history.json holds.

    `echo` prints the round lines as ``ort-lightning fleet`` does; `flower_log` keeps Flower's own log;
    `search` holds folders searched first for ``model.factory`` and ``data.class_path``.
    """
    if not isinstance(config, FleetConfig):
        config = FleetConfig.from_dict(config)
    with _quiet(flower_log):
        data, test = fleet_data(config, search=search)
        example = [tensor[:2] for tensor in next(iter(data(0, config.devices.count).train))]
        artifacts = fleet_artifacts(config, example, search=search)
        run_experiment(config, artifacts, None if config.engine.page_data else data, test=test, echo=echo)
        if config.output.pretrained:
            written = write_last_round(config, artifacts)
            if echo:
                print(f"pretrained:        {written}")
    return json.loads((Path(config.output.folder) / "history.json").read_text(encoding="utf-8"))


@contextlib.contextmanager
def _quiet(flower_log: bool) -> Iterator[None]:
    """Flower's log at ERROR (unless asked for) and Lightning's per-device lines off, for the run only."""
    # NOTE: Flower logs ~100 INFO lines per run, coloured even when redirected, and warns about
    # fraction_evaluate=0.0, a default here (the server measures the global model itself).
    names = ["lightning.pytorch", "lightning.fabric"] + ([] if flower_log else ["flwr"])
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            # NOTE: a device's fit has no validation data by design.
            warnings.filterwarnings("ignore", message=".*but have no `val_dataloader`.*")
            yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
