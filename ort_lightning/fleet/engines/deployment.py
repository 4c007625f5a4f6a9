"""The digits fleet as a Flower app for Flower's deployment runtime: a SuperLink, SuperNodes, ``flwr run``.

`client` (a ``ClientApp``) and `server` (a ``ServerApp``) are the apps that a Flower app project
names in its ``pyproject.toml``; ``examples/fleet_app`` is such a project, and docs/fleets.md
("From the simulation to Flower's deployment runtime") gives the commands. Both read Flower's run config: the keys of a
`FleetConfig` (``devices``, ``rounds``, ``epochs``, ``lr``, ``split``, ``strategy``, ``out``, ...)
plus ``artifacts``, the artifacts folder, which every machine holds at that path. Each SuperNode
is one device: its node config (``partition-id``, ``num-partitions``) chooses its share of the
digits, and it trains as a device does (`DeviceClient`, from its nominal checkpoint plus the
server's values) on its device folder: the ``artifacts`` folder prepared once per SuperNode
process with ``lr`` in its optimizer graph (`prepare_for_web`), or ``artifacts`` itself where it
is such a folder already, at that rate.
The server first gives all ``devices`` SuperNodes up to ``device_timeout`` seconds to connect;
before each round it then waits for ``min_nodes`` of them (by default ``devices - 1``, at least
1: a round goes on after one SuperNode is lost), trains on every SuperNode connected then, gives
each ``device_timeout`` seconds to answer, writes a complete ORT checkpoint per round under
``out/rounds`` and prints the accuracy per round, with the nodes that failed it, into the run's
log (``flwr log``, or``flwr run --stream``).

Example::

    >>> config, artifacts = read_run_config({"artifacts": "/srv/fleet/artifacts", "devices": 2, "rounds": 1})
    >>> config.devices, config.rounds, artifacts.name
    (2, 1, 'artifacts')
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
from flwr.serverapp import Grid, ServerApp

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader
from ort_lightning.fleet.devices.client import DeviceClient
from ort_lightning.fleet.devices.clipping import clip_when_asked

__all__ = ["client", "read_run_config", "server"]


def read_run_config(run_config: Mapping[str, object]) -> tuple[FleetConfig, Path]:
    """The experiment and the artifacts folder that a run config names.

    Args:
        run_config: Flower's run config (``[tool.flwr.app.config]``, with ``flwr run --run-config`` overrides).

    Raises:
        ConfigurationError: without an ``artifacts`` key, or for keys `FleetConfig` refuses.
    """
    values = dict(run_config)
    artifacts = values.pop("artifacts", None)
    if not artifacts:
        raise ConfigurationError(
            "The run config has no `artifacts` key; add artifacts = \"/path/to/artifacts\" under "
            "[tool.flwr.app.config] of the app's pyproject.toml, or pass flwr run ... --run-config "
            "\"artifacts='/path/to/artifacts'\" (a folder that every machine holds at that path)."
        )
    return FleetConfig.from_dict(values), Path(str(artifacts))


# ----------------------------------------------------------------------------- the device
client = ClientApp(mods=[clip_when_asked])


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
    data = DigitsPartitions(split=config.split, batch_size=config.batch_size, seed=config.seed)
    return DeviceClient(_device_folder(str(artifacts), config.lr), data, epochs=config.epochs, runner=config.runner,
                        optimizer_state=config.optimizer_state, start=config.start)


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
            f"The run config's lr={lr}, but the device folder {artifacts} computes its own rate "
            f"({schedule.describe()}); pass lr={schedule.lr} in the run config, or name the exported folder, which "
            "each SuperNode prepares with the run config's lr."
        )
    return loaded.directory


# ----------------------------------------------------------------------------- the server
server = ServerApp()


@server.main()
def _main(grid: Grid, context: Context) -> None:
    # The server's parts (Lightning among them) are imported here: each SuperNode loads this module for
    # `client`, and a device imports no Lightning (tests/fleet/devices/test_fleet_device.py).
    from ort_lightning.fleet.server.assembly import fleet_server
    from ort_lightning.fleet.server.report import report

    config, artifacts = read_run_config(context.run_config)
    # NOTE: Flower's strategies wait for `min_available_nodes` before every round, for ever: waiting for
    # all `devices` would hang the run at the next round once one SuperNode is lost.
    fleet = fleet_server(config, artifacts, digits_test_loader(config.seed), min_nodes=config.nodes_to_wait_for)
    _wait_for_nodes(grid, config.devices, config.device_timeout)
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
