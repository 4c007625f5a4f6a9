"""The digits fleet as a Flower app for Flower's deployment runtime: a SuperLink, SuperNodes, ``flwr run``.

`client` (a ``ClientApp``) and `server` (a ``ServerApp``) are the apps that a Flower app project
names in its ``pyproject.toml``; ``examples/fleet_app`` is such a project, and docs/fleets.md
("From the simulation to Flower's deployment runtime") gives the commands. Both read Flower's run
config: the fleet config's sections as TOML tables (``[tool.flwr.app.config.devices]``; Flower
joins their keys with dots, ``--run-config "devices.count=3"``), with ``model.artifacts`` the
artifacts folder every machine holds at that path. Each SuperNode is one device: its node config
(``partition-id``, ``num-partitions``) chooses its share of the data section's set, and it trains as a device
does (`DeviceClient`) on ``model.artifacts`` prepared once per process with ``devices.lr`` in its
optimizer graph (`prepare_for_web`), or on that folder itself where it is such a folder already.
The server first gives all ``devices.count`` SuperNodes up to ``devices.timeout`` seconds to
connect; before each round it waits for ``devices.min_nodes`` of them (by default count - 1: a
round goes on after one SuperNode is lost), writes a complete ORT checkpoint per round and prints
the round lines into the run's log (``flwr log``, or ``flwr run --stream``).

Example::

    >>> config, artifacts = read_run_config({"model.artifacts": "/srv/fleet/artifacts", "devices.count": 2})
    >>> config.devices.count, artifacts.name
    (2, 'artifacts')
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.config import unflatten_dict
from flwr.serverapp import Grid, ServerApp

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.data.sources import fleet_data
from ort_lightning.fleet.devices.client import DeviceClient
from ort_lightning.fleet.devices.clipping import clip_when_asked
from ort_lightning.fleet.devices.legacy_fit import secure_when_asked

__all__ = ["client", "read_run_config", "server"]


def read_run_config(run_config: Mapping[str, object]) -> tuple[FleetConfig, Path]:
    """The experiment and the artifacts folder that a run config names.

    Args:
        run_config: Flower's run config (``[tool.flwr.app.config]``'s tables, their keys joined with dots).

    Raises:
        ConfigurationError: without ``model.artifacts``, or for keys `FleetConfig` refuses.
    """
    config = FleetConfig.from_dict(unflatten_dict(dict(run_config)), where="the run config")
    if not config.model.artifacts:
        raise ConfigurationError(
            "The run config has no `model.artifacts` key; add artifacts = \"/path/to/artifacts\" under "
            "[tool.flwr.app.config.model] of the app's pyproject.toml, or pass flwr run ... --run-config "
            "\"model.artifacts='/path/to/artifacts'\" (a folder that every machine holds at that path)."
        )
    return config, Path(config.model.artifacts)


# ----------------------------------------------------------------------------- the device
client = ClientApp(mods=[clip_when_asked, secure_when_asked])


@client.train()
def _train(message: Message, context: Context) -> Message:
    config, artifacts = read_run_config(context.run_config)
    return _client(config, artifacts).train(message, context)


@client.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    config, artifacts = read_run_config(context.run_config)
    return _client(config, artifacts).evaluate(message, context)


def _client(config: FleetConfig, artifacts: Path) -> DeviceClient:
    """The device of this app: its SuperNode's share of the digits, on its device folder."""
    devices = config.devices
    data, _ = fleet_data(config)  # the digits by default; a data module must be importable on the SuperNode
    return DeviceClient(_device_folder(str(artifacts), devices.lr), data, epochs=devices.epochs, runner=devices.runner,
                        optimizer_state=devices.optimizer_state, start=devices.start)


@functools.lru_cache(maxsize=2)
def _device_folder(artifacts: str, lr: float) -> Path:
    """`artifacts` with `lr` in its optimizer graph: prepared once per process, or `artifacts` if it has that rate.

    Raises:
        ConfigurationError: for a folder prepared with another rate than the run config's `lr`.
    """
    loaded = TrainingArtifacts.load(artifacts)
    schedule = loaded.manifest.lr_schedule
    if schedule is None:
        from ort_lightning.export import prepare_for_web  # the exporter's side, for a folder still to prepare

        root = tempfile.mkdtemp(prefix="ort-lightning-device-")
        atexit.register(shutil.rmtree, root, True)
        return prepare_for_web(loaded, Path(root) / "device", lr=lr).directory
    if (schedule.kind, schedule.lr) != ("constant", lr):
        raise ConfigurationError(
            f"The run config's devices.lr={lr}, but the device folder {artifacts} computes its own rate "
            f"({schedule.describe()}); pass devices.lr={schedule.lr} in the run config, or name the exported folder, "
            "which each SuperNode prepares with the run config's devices.lr."
        )
    return loaded.directory


# ----------------------------------------------------------------------------- the server
server = ServerApp()


@server.main()
def _main(grid: Grid, context: Context) -> None:
    # The server's parts (Lightning among them) are imported here: each SuperNode loads this module for
    # `client`, and a device imports no Lightning (tests/fleet/devices/test_fleet_device.py).
    from ort_lightning.fleet.server.assembly import fleet_server, secure_server
    from ort_lightning.fleet.server.report import report

    config, artifacts = read_run_config(context.run_config)
    # NOTE: Flower's strategies wait for `min_available_nodes` before every round, for ever: waiting for
    # all `devices` would hang the run at the next round once one SuperNode is lost.
    test = fleet_data(config)[1]
    fleet = (secure_server(config, artifacts, test, min_nodes=config.nodes_to_wait_for) if config.secagg.enabled
             else fleet_server(config, artifacts, test, min_nodes=config.nodes_to_wait_for))
    _wait_for_nodes(grid, config.devices.count, config.devices.timeout)
    started = time.perf_counter()
    fleet.main(grid, context)
    report(fleet, config, time.perf_counter() - started, engine="Flower deployment runtime")


def _wait_for_nodes(grid: Grid, count: int, limit: float | None) -> None:
    """Wait until `count` nodes are connected, for at most `limit` seconds (the first round then has them all)."""
    # NOTE: the strategy starts a round as soon as `min_nodes` are connected; at start-up that would
    # leave the SuperNodes that connect a second later out of the first round.
    deadline = time.monotonic() + (limit if limit is not None else float("inf"))
    while len(list(grid.get_node_ids())) < count and time.monotonic() < deadline:
        time.sleep(0.5)
