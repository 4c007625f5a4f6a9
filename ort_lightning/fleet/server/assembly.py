"""What a fleet experiment is built from: the device folder and the server (each device's client: `devices.client`).

Each takes the `FleetConfig` and the artifacts; the data comes as an argument (``data`` for the
devices, ``test`` for the server's evaluation), so that nothing here knows a data set.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from flwr.serverapp.strategy import Strategy
from torch.utils.data import DataLoader

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.export import prepare_for_web
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.server.global_model import GlobalModel
from ort_lightning.fleet.server.secure import SecureFleetServer
from ort_lightning.fleet.server.server_app import FleetServer
from ort_lightning.fleet.server.strategies import strategy_from

__all__ = ["device_folder", "fleet_server", "quiet_ray", "secure_server"]


def _strategy(config: FleetConfig, min_nodes: int | None) -> Strategy:
    return strategy_from(dataclasses.asdict(config.strategy), config.privacy.wrapper(), config.devices.count,
                         min_nodes=min_nodes, lr=config.devices.lr)


def device_folder(config: FleetConfig, artifacts: str | os.PathLike[str]) -> TrainingArtifacts:
    """The folder every device trains: ``output.folder/device``, whose optimizer graph computes ``devices.lr``.

    Written by `prepare_for_web` from `artifacts` (constant rate, ``.ort`` graphs, the nominal
    checkpoint): the files a browser loads, and the ones a simulated device opens.
    """
    return prepare_for_web(artifacts, Path(config.output.folder) / "device", lr=config.devices.lr)


def fleet_server(
    config: FleetConfig, artifacts: str | os.PathLike[str], test: DataLoader | None = None, *,
    min_nodes: int | None = None,
) -> FleetServer:
    """The experiment's server: its strategy and rounds, a checkpoint per round in ``output.folder/rounds``.

    `test` holds the batches the global model is evaluated on after every round (None: no evaluation);
    `min_nodes`, the devices each round waits for (`strategy_from`'s).
    """
    model = GlobalModel(Path(artifacts), checkpoint=config.output.resume)
    return FleetServer(model, _strategy(config, min_nodes), rounds=config.rounds, test=test,
                       directory=Path(config.output.folder) / "rounds", device_timeout=config.devices.timeout)


def secure_server(
    config: FleetConfig, artifacts: str | os.PathLike[str], test: DataLoader | None = None, *,
    min_nodes: int | None = None,
) -> SecureFleetServer:
    """The experiment's server with ``secagg.enabled``: FedAvg through Flower's SecAgg+ (see `fleet_server`)."""
    model = GlobalModel(Path(artifacts), checkpoint=config.output.resume)
    return SecureFleetServer(model, rounds=config.rounds, test=test, directory=Path(config.output.folder) / "rounds",
                             devices=config.devices.count, secagg=config.secagg.workflow(),
                             privacy=config.privacy.wrapper(), min_nodes=min_nodes,
                             device_timeout=config.devices.timeout)


def quiet_ray() -> None:
    """Tell Ray what its start-up ``FutureWarning`` asks for, so that the Ray engine prints the round lines alone.

    Ray 2.55 warns at start-up that it will stop overriding ``CUDA_VISIBLE_DEVICES`` for actors with
    ``num_gpus=0``; the devices ask for no GPU, so the future behaviour is the one wanted. A value the
    user set stays.
    """
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
