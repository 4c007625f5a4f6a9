"""Fleet experiments: federated training of the very artifacts that ship, on Flower.

Needs the ``fleet`` extra (``pip install "ort-lightning[fleet]"``, which installs
``flwr[simulation]``). `run_fleet` runs a fleet from a `FleetConfig`'s sections and returns its history. A `DeviceClient` is what each simulated device runs: ONNX Runtime's
device loop on the device folder, what a phone or a browser runs (`ort_lightning.ort.device`).
A `FleetClient` runs a Lightning ``Trainer`` over an `ORTLightningModule` instead, for those who
ask for it by name: no device has a Trainer. The server runs Flower's own
strategies, wrapped by `CheckpointEachRound` so that each round's global values become a
complete ORT checkpoint. `LocalGrid` runs the same apps in this process, without Ray.

The subpackage sits above ``training``: nothing below it imports it. Its names are imported on
first use, so that a device (`DeviceClient`, the deployment's ``client``) imports no Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    import flwr  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'ort_lightning.fleet needs Flower; install it with pip install "ort-lightning[fleet]".'
    ) from error

from ort_lightning._lazy import lazy_names

if TYPE_CHECKING:
    from ort_lightning.fleet.app import FleetServer, RoundRecord
    from ort_lightning.fleet.client import FleetClient, evaluate_module
    from ort_lightning.fleet.config import FleetConfig
    from ort_lightning.fleet.device import DeviceClient
    from ort_lightning.fleet.experiment import run_fleet
    from ort_lightning.fleet.local import LocalGrid, run_local
    from ort_lightning.fleet.parameters import get_values, set_values, state_order
    from ort_lightning.fleet.protocol import ClientData
    from ort_lightning.fleet.server import CheckpointEachRound, GlobalModel, round_path

#: Each public name and the module it comes from.
_HOMES = {
    "CheckpointEachRound": "ort_lightning.fleet.server",
    "ClientData": "ort_lightning.fleet.protocol",
    "DeviceClient": "ort_lightning.fleet.device",
    "FleetClient": "ort_lightning.fleet.client",
    "FleetConfig": "ort_lightning.fleet.config",
    "FleetServer": "ort_lightning.fleet.app",
    "GlobalModel": "ort_lightning.fleet.server",
    "LocalGrid": "ort_lightning.fleet.local",
    "RoundRecord": "ort_lightning.fleet.app",
    "evaluate_module": "ort_lightning.fleet.client",
    "get_values": "ort_lightning.fleet.parameters",
    "round_path": "ort_lightning.fleet.server",
    "run_fleet": "ort_lightning.fleet.experiment",
    "run_local": "ort_lightning.fleet.local",
    "set_values": "ort_lightning.fleet.parameters",
    "state_order": "ort_lightning.fleet.parameters",
}

__all__ = [
    "CheckpointEachRound",
    "ClientData",
    "DeviceClient",
    "FleetClient",
    "FleetConfig",
    "FleetServer",
    "GlobalModel",
    "LocalGrid",
    "RoundRecord",
    "evaluate_module",
    "get_values",
    "round_path",
    "run_fleet",
    "run_local",
    "set_values",
    "state_order",
]


__getattr__, __dir__ = lazy_names(globals(), _HOMES)
