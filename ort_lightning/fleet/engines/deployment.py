"""The digits fleet as a Flower app for Flower's deployment runtime: a SuperLink, SuperNodes, ``flwr run``.

`client` (a ``ClientApp``) and `server` (a ``ServerApp``) are the apps that a Flower app project
names in its ``pyproject.toml``; ``examples/fleet_app`` is such a project, and docs/fleets.md
("From the simulation to Flower's deployment runtime") gives the commands. Both read Flower's run
config: the fleet config's sections as TOML tables (``[tool.flwr.app.config.devices]``; Flower
joins their keys with dots, ``--run-config "devices.count=3"``), with ``model.artifacts`` the
artifacts folder every machine holds at that path. Each SuperNode is one device: its node config
(``partition-id``, ``num-partitions``) chooses its share of the digits. The server first gives all
``devices.count`` SuperNodes up to ``devices.timeout`` seconds to connect; before each round it
waits for ``devices.min_nodes`` of them (by default count - 1: a round goes on after one SuperNode
is lost), writes a complete ORT checkpoint per round and prints the round lines into the run's log.

Example::

    >>> config, artifacts = read_run_config({"model.artifacts": "/srv/fleet/artifacts", "devices.count": 2})
    >>> config.devices.count, artifacts.name
    (2, 'artifacts')
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.config import unflatten_dict
from flwr.serverapp import Grid, ServerApp

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader
from ort_lightning.fleet.devices.client import fleet_client

if TYPE_CHECKING:
    from ort_lightning.fleet.devices.ort_loop import DeviceClient
    from ort_lightning.fleet.devices.trainer_loop import FleetClient

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
client = ClientApp()


@client.train()
def _train(message: Message, context: Context) -> Message:
    config, artifacts = read_run_config(context.run_config)
    return _client(config, artifacts).train(message, context)


@client.evaluate()
def _evaluate(message: Message, context: Context) -> Message:
    config, artifacts = read_run_config(context.run_config)
    return _client(config, artifacts).evaluate(message, context)


def _client(config: FleetConfig, artifacts: Path) -> DeviceClient | FleetClient:
    """The device of this app: its SuperNode's share of the digits."""
    return fleet_client(config, artifacts, DigitsPartitions(split=config.data.partition,
                                                            batch_size=config.devices.batch_size, seed=config.seed))


# ----------------------------------------------------------------------------- the server
server = ServerApp()


@server.main()
def _main(grid: Grid, context: Context) -> None:
    # The server's parts (Lightning among them) are imported here: each SuperNode loads this module for
    # `client`, and a device imports no Lightning (tests/test_fleet_device.py).
    from ort_lightning.fleet.server.assembly import fleet_server
    from ort_lightning.fleet.server.report import report

    config, artifacts = read_run_config(context.run_config)
    # NOTE: Flower's strategies wait for `min_available_nodes` before every round, for ever: waiting for
    # all `devices` would hang the run at the next round once one SuperNode is lost.
    nodes = config.nodes_to_wait_for
    waiting = {"min_available_nodes": nodes, "min_train_nodes": nodes}
    config = config.replace(strategy={"options": {**waiting, **config.strategy.options}})
    fleet = fleet_server(config, artifacts, digits_test_loader(config.seed))
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
