"""A device's checked result as Flower's reply: the weights by name, FedAvg's weight, the loss and the page's timings.

Example::

    >>> import numpy as np
    >>> from ort_lightning.fleet.devices.frames import Result
    >>> from ort_lightning.fleet.devices.weights import WeightOrder
    >>> result = Result(np.arange(3, dtype=np.float32), examples=8, steps=2, losses=[0.9, 0.5])
    >>> arrays, metrics = reply_records(result, {"seconds": 0.5}, WeightOrder([("w", (3,))]), last_epoch=1)
    >>> arrays["w"].numpy().tolist(), metrics["num-examples"], metrics["train_loss"], metrics["steps_per_second"]
    ([0.0, 1.0, 2.0], 8, 0.5, 4.0)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from ort_lightning.fleet.devices.frames import Result
from ort_lightning.fleet.devices.protocol import WEIGHT_KEY
from ort_lightning.fleet.devices.weights import WeightOrder

__all__ = ["reply_records"]


def _timings(header: dict[str, Any]) -> dict[str, float]:
    """The page's own timings: its local fit, its first step alone, opening its session (NaN when absent)."""
    names = {"fit_seconds": "seconds", "first_step_seconds": "first_step_seconds", "open_seconds": "open_seconds"}
    timings = {ours: float(v) if isinstance(v := header.get(theirs), (int, float)) else math.nan
               for ours, theirs in names.items()}
    # NOTE: a page's set-up is opening its session; the steps' rate is a simulated device's column too.
    timings["setup_seconds"] = timings["open_seconds"]
    return timings


def reply_records(
    result: Result, header: dict[str, Any], weight_order: WeightOrder, *, last_epoch: int | None
) -> tuple[ArrayRecord, MetricRecord]:
    """The reply's arrays (named by `weight_order`) and metrics; `last_epoch`: its steps, else the device's count."""
    steps = last_epoch if last_epoch is not None else result.last_epoch_steps
    last = result.losses[-steps:] if steps else []
    timings = _timings(header)
    rate = result.steps / timings["fit_seconds"] if timings["fit_seconds"] > 0 else math.nan
    metrics: dict[str, int | float | list[int] | list[float]] = {
        WEIGHT_KEY: result.examples, "train_loss": float(np.mean(last)) if last else math.nan,
        "steps": result.steps, "steps_per_second": rate, **timings,
    }
    return weight_order.record(result.weights), MetricRecord(metrics)
