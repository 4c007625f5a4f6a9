"""The client each device of an experiment runs, by its ``runner``: ONNX Runtime's device loop or a Trainer.

A device imports Lightning only where the experiment asks for ``runner: lightning``: a SuperNode
that runs the default ``runner: ort`` loads `ort_lightning.fleet.devices.ort_loop` and nothing of Lightning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.devices.ort_loop import DeviceClient
from ort_lightning.fleet.devices.protocol import DataFn

if TYPE_CHECKING:
    from ort_lightning.fleet.devices.trainer_loop import FleetClient

__all__ = ["fleet_client"]


def fleet_client(
    config: FleetConfig, artifacts: str | os.PathLike[str], data: DataFn
) -> DeviceClient | FleetClient:
    """What each device of the experiment runs on the folder `artifacts`: its node's partition of `data`, the options.

    ``runner: ort`` runs ONNX Runtime's device loop (`DeviceClient`) at ``lr``: computed by the
    optimizer graph of a prepared folder (`ort_lightning.fleet.server.assembly.device_folder`), set through
    ORT's ``set_learning_rate`` on a plain one. ``runner: lightning`` runs a Trainer over an
    `ORTLightningModule` (`FleetClient`).
    """
    kind: type[DeviceClient] | type[FleetClient] = DeviceClient
    if config.devices.runner == "lightning":
        from ort_lightning.fleet.devices.trainer_loop import FleetClient  # Lightning, for the runner that asks for it

        kind = FleetClient
    devices = config.devices
    return kind(Path(artifacts), data, epochs=devices.epochs, lr=devices.lr, optimizer_state=devices.optimizer_state,
                start=devices.start)
