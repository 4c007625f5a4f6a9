"""What a fleet's server and devices agree on, without Lightning: record keys, a device's options and data.

Nothing here may import Lightning: a device imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError

__all__ = [
    "ARRAYS_KEY", "DEVICE_TIMEOUT", "LEFT_ERROR_CODE", "METRICS_KEY", "OPTIMIZER_STATES", "RUNNERS", "STARTS",
    "WEIGHT_KEY", "ClientData", "DataFn", "Fit", "Loop", "check_client_options",
]

#: Record keys, as Flower's strategies name them by default.
ARRAYS_KEY = "arrays"
METRICS_KEY = "metrics"
WEIGHT_KEY = "num-examples"
#: ``fresh``: a new ORT optimizer every round; ``keep``: each device keeps its own between rounds.
OPTIMIZER_STATES = ("fresh", "keep")
#: A device's local training: ONNX Runtime's device loop (what a real device runs), or a Lightning Trainer.
RUNNERS = ("ort", "lightning")
#: Where a device starts: its nominal checkpoint plus the server's values, or its complete checkpoint.
STARTS = ("auto", "nominal", "complete")
#: Seconds a device may take to answer a round by default (ten minutes: far above a device's
#: local fit in these experiments, which is seconds, and far below "for ever").
DEVICE_TIMEOUT = 600.0
#: Error code of the reply owed by a device that left the fleet on purpose: a departure, not a failure
#: (Flower's own codes, ``flwr.common.constant.ErrorCode``, stop below 100).
LEFT_ERROR_CODE = 100


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


@dataclass(frozen=True)
class Fit:
    """One device's local training: values, an epoch's examples, last epoch's mean loss, steps, times, kept state."""

    values: ArrayRecord
    examples: int
    loss: float
    steps: int
    started: float
    seconds: float
    checkpoint: bytes | None


class Loop(Protocol):
    """A device's local training: ONNX Runtime's device loop (`OrtLoop`) or a Trainer's (`TrainerLoop`)."""

    def train(self, arrays: ArrayRecord, loader: Any, *, epochs: int, kept: Path | None, keep: bool) -> Fit:
        """Train the server's `arrays` on `loader`, from the device's `kept` checkpoint if any."""

    def evaluate(self, arrays: ArrayRecord, loader: Any) -> Iterator[tuple[float, np.ndarray | None, np.ndarray]]:
        """Per batch of `loader`: the eval graph's loss, its logits (or None) and the labels."""


def check_client_options(optimizer_state: str, start: str, epochs: int) -> None:
    """Check a device's options (`DeviceClient`'s).

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
