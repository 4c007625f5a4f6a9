"""What a fleet's server and devices agree on, without Lightning: record keys, a device's options and data.

A device imports this module and `ort_lightning.fleet.devices.ort_loop` only: no device has a ``Trainer``,
so nothing here may import Lightning (``tests/test_fleet_device.py`` runs a device with Lightning
absent).

Example::

    >>> check_client_options("keep", "nominal", 2)
    >>> check_client_options("forever", "nominal", 2)
    Traceback (most recent call last):
    ...
    ort_lightning.errors.ConfigurationError: Expected `optimizer_state` to be one of ('fresh', 'keep'), ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError

__all__ = [
    "ARRAYS_KEY", "DEVICE_TIMEOUT", "METRICS_KEY", "OPTIMIZER_STATES", "STARTS", "WEIGHT_KEY", "ClientData", "DataFn",
    "check_client_options",
]

#: Record keys, as Flower's strategies name them by default.
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
WEIGHT_KEY = "num-examples"
#: ``fresh``: a new ORT optimizer every round; ``keep``: each device keeps its own between rounds.
OPTIMIZER_STATES = ("fresh", "keep")
#: Where a device starts: its nominal checkpoint plus the server's values, or its complete checkpoint.
STARTS = ("auto", "nominal", "complete")
#: Seconds a device may take to answer a round by default (ten minutes: far above a device's
#: local fit in these experiments, which is seconds, and far below "for ever").
DEVICE_TIMEOUT = 600.0


@dataclass(frozen=True)
class ClientData:
    """One device's data: training batches, and optionally evaluation batches.

    Attributes:
        train: batches in the order of the training graph's inputs (model inputs, then labels).
        test: batches for ``evaluate`` messages; None means the device does not evaluate.
    """

    train: DataLoader
    test: DataLoader | None = None


#: ``(partition_id, num_partitions) -> ClientData``: a device's data, from Flower's node config.
DataFn = Callable[[int, int], ClientData]


def check_client_options(optimizer_state: str, start: str, epochs: int) -> None:
    """Check a device's options (`FleetClient`'s and `DeviceClient`'s).

    Raises:
        ConfigurationError: for an unknown `optimizer_state` or `start`, or a non-positive `epochs`.
    """
    if optimizer_state not in OPTIMIZER_STATES:
        raise ConfigurationError(
            f"Expected `optimizer_state` to be one of {OPTIMIZER_STATES}, but got {optimizer_state!r}; "
            'pass "fresh" (a new optimizer every round) or "keep" (each client keeps its own).'
        )
    if start not in STARTS:
        raise ConfigurationError(
            f"Expected `start` to be one of {STARTS}, but got {start!r}; pass \"nominal\" (the nominal "
            'checkpoint plus the server\'s values), "complete" (the complete checkpoint) or "auto".'
        )
    if epochs < 1:
        raise ConfigurationError(f"Expected `epochs` >= 1, but got {epochs}; pass the local epochs per round.")
