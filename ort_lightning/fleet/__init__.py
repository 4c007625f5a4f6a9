"""Fleet experiments: federated training of the very artifacts that ship, on Flower.

Needs the ``fleet`` extra (``pip install "ort-lightning[fleet]"``, which installs
``flwr[simulation]``). A `DeviceClient` is what each simulated device runs: ONNX Runtime's
device loop on the device folder, what a phone or a browser runs (`ort_lightning.ort.device`).
A `FleetClient` runs a Lightning ``Trainer`` over an `ORTLightningModule` instead, for those who
ask for it by name: no device has a Trainer. The server runs Flower's own
strategies, wrapped by `CheckpointEachRound` so that each round's global values become a
complete ORT checkpoint. `LocalGrid` runs the same apps in this process, without Ray.

The subpackage sits above ``training``: nothing below it imports it.
"""

from __future__ import annotations

try:
    import flwr  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'ort_lightning.fleet needs Flower; install it with pip install "ort-lightning[fleet]".'
    ) from error

from ort_lightning.fleet.app import FleetServer, RoundRecord
from ort_lightning.fleet.client import ClientData, FleetClient, evaluate_module
from ort_lightning.fleet.device import DeviceClient
from ort_lightning.fleet.local import LocalGrid, run_local
from ort_lightning.fleet.parameters import get_values, set_values, state_order
from ort_lightning.fleet.server import CheckpointEachRound, GlobalModel, round_path

__all__ = [
    "CheckpointEachRound",
    "ClientData",
    "DeviceClient",
    "FleetClient",
    "FleetServer",
    "GlobalModel",
    "LocalGrid",
    "RoundRecord",
    "evaluate_module",
    "get_values",
    "round_path",
    "run_local",
    "set_values",
    "state_order",
]
