"""Fleet experiments: federated training of the very artifacts that ship, on Flower.

Needs the ``fleet`` extra (``pip install "ort-lightning[fleet]"``, which installs
``flwr[simulation]``). `run_fleet` runs a fleet from a `FleetConfig`'s sections and returns its
history (docs/fleets.md). A `DeviceClient` is what each device runs on every engine: ONNX Runtime's
device loop on the device folder, what a phone or a browser runs (`ort_lightning.ort.on_device`),
or a Lightning ``Trainer`` over an `ORTLightningModule` for those who ask for it
(``runner="lightning"``): no device has a Trainer. The server runs Flower's own strategies
(`strategy_from`: any of them by name, with the fleet's defaults and checks), wrapped by
`CheckpointEachRound` so that each round's global values become a complete ORT checkpoint.
`LocalGrid` runs the same apps in this process, without Ray.

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
    from ort_lightning.fleet.config.fleet_config import FleetConfig
    from ort_lightning.fleet.devices.client import DeviceClient
    from ort_lightning.fleet.devices.protocol import ClientData
    from ort_lightning.fleet.devices.state_values import get_values, set_values
    from ort_lightning.fleet.devices.trainer_loop import evaluate_module
    from ort_lightning.fleet.devices.weight_order import WeightOrder
    from ort_lightning.fleet.engines.browser import BrowserDevice, BrowserFleet, BrowserGrid, Refusal
    from ort_lightning.fleet.engines.local import LocalGrid, run_local
    from ort_lightning.fleet.run import run_fleet
    from ort_lightning.fleet.server.global_model import CheckpointEachRound, GlobalModel, round_path
    from ort_lightning.fleet.server.secure import SecureFleetServer, secure_mods
    from ort_lightning.fleet.server.server_app import FleetServer, RoundRecord
    from ort_lightning.fleet.server.strategies import strategy_from

#: Each public name and the module it comes from.
_HOMES = {
    "BrowserDevice": "ort_lightning.fleet.engines.browser",
    "BrowserFleet": "ort_lightning.fleet.engines.browser",
    "BrowserGrid": "ort_lightning.fleet.engines.browser",
    "Refusal": "ort_lightning.fleet.engines.browser",
    "CheckpointEachRound": "ort_lightning.fleet.server.global_model",
    "ClientData": "ort_lightning.fleet.devices.protocol",
    "DeviceClient": "ort_lightning.fleet.devices.client",
    "FleetConfig": "ort_lightning.fleet.config.fleet_config",
    "FleetServer": "ort_lightning.fleet.server.server_app",
    "GlobalModel": "ort_lightning.fleet.server.global_model",
    "LocalGrid": "ort_lightning.fleet.engines.local",
    "RoundRecord": "ort_lightning.fleet.server.server_app",
    "SecureFleetServer": "ort_lightning.fleet.server.secure",
    "WeightOrder": "ort_lightning.fleet.devices.weight_order",
    "evaluate_module": "ort_lightning.fleet.devices.trainer_loop",
    "get_values": "ort_lightning.fleet.devices.state_values",
    "round_path": "ort_lightning.fleet.server.global_model",
    "secure_mods": "ort_lightning.fleet.server.secure",
    "run_fleet": "ort_lightning.fleet.run",
    "run_local": "ort_lightning.fleet.engines.local",
    "set_values": "ort_lightning.fleet.devices.state_values",
    "strategy_from": "ort_lightning.fleet.server.strategies",
}

__all__ = [
    "BrowserDevice",
    "BrowserFleet",
    "BrowserGrid",
    "CheckpointEachRound",
    "ClientData",
    "DeviceClient",
    "FleetConfig",
    "FleetServer",
    "GlobalModel",
    "LocalGrid",
    "Refusal",
    "RoundRecord",
    "SecureFleetServer",
    "WeightOrder",
    "evaluate_module",
    "get_values",
    "round_path",
    "run_fleet",
    "run_local",
    "secure_mods",
    "set_values",
    "strategy_from",
]


__getattr__, __dir__ = lazy_names(globals(), _HOMES)
