"""What a fleet experiment is built from: the device folder and the server (each device's client: `devices.client`).

Each takes the `FleetConfig` and the artifacts; the data comes as an argument (``data`` for the
devices, ``test`` for the server's evaluation), so that nothing here knows a data set.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import Strategy
from torch.utils.data import DataLoader

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import prepare_for_web
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.server.global_model import GlobalModel
from ort_lightning.fleet.server.server_app import FleetServer

__all__ = ["device_folder", "fleet_server", "quiet_ray"]


def strategy_from(strategy: Mapping[str, Any], privacy: Mapping[str, Any] | None, devices: int) -> Strategy:
    """The Flower strategy of the ``strategy`` section with the fleet's defaults (``privacy``: none yet)."""
    import flwr.serverapp.strategy as flower

    if privacy is not None:
        raise ConfigurationError(f"`privacy.side: {privacy['side']}` is not served yet; set privacy.side: null.")
    kind = {name.lower(): getattr(flower, name) for name in flower.__all__}[strategy["name"]]
    options = {"fraction_evaluate": 0.0, "min_available_nodes": min(2, devices), "min_train_nodes": min(2, devices),
               **strategy["options"]}
    if strategy["name"] == "fedprox":
        options.setdefault("proximal_mu", 0.0)
    return kind(**options)


def device_folder(config: FleetConfig, artifacts: str | os.PathLike[str]) -> TrainingArtifacts:
    """The folder every device of the experiment trains: ``out/device``, whose optimizer graph computes ``lr``.

    Written by `prepare_for_web` from `artifacts` (constant rate, ``.ort`` graphs, the nominal
    checkpoint): the files a browser loads, and the ones a simulated device opens.
    """
    return prepare_for_web(artifacts, Path(config.output.folder) / "device", lr=config.devices.lr)


def fleet_server(
    config: FleetConfig, artifacts: str | os.PathLike[str], test: DataLoader | None = None
) -> FleetServer:
    """The experiment's server: its strategy and rounds, a checkpoint per round in ``out/rounds``.

    `test` holds the batches the global model is evaluated on after every round (None: no evaluation).
    """
    model = GlobalModel(Path(artifacts), checkpoint=config.output.resume)
    strategy = strategy_from(dataclasses.asdict(config.strategy), config.privacy.wrapper(), config.devices.count)
    return FleetServer(model, strategy, rounds=config.rounds, directory=Path(config.output.folder) / "rounds",
                       test=test, device_timeout=config.devices.timeout)


def quiet_ray() -> None:
    """Tell Ray what its start-up ``FutureWarning`` asks for, so that the Ray engine prints the round lines alone.

    Ray 2.55 warns at start-up that it will stop overriding ``CUDA_VISIBLE_DEVICES`` for actors with
    ``num_gpus=0``; the devices ask for no GPU, so the future behaviour is the one wanted. A value the
    user set stays.
    """
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
