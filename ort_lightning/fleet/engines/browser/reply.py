"""A device's checked answer as Flower's reply: the weights by name, FedAvg's weight, the loss and the page's timings.

`Asked` is what a frame asked of its device; `answer_content` checks the answer against it: a result
frame's weights, or a SecAgg+ stage's record as ``secaggplus_mod`` replies it (its masked vectors at
the collect stage, never the weights).

Example::

    >>> import numpy as np
    >>> from ort_lightning.fleet.devices.frames import Result
    >>> from ort_lightning.fleet.devices.weight_order import WeightOrder
    >>> result = Result(np.arange(3, dtype=np.float32), examples=8, steps=2, losses=[0.9, 0.5])
    >>> arrays, metrics = reply_records(result, {"seconds": 0.5}, WeightOrder([("w", (3,))]), last_epoch=1)
    >>> arrays["w"].numpy().tolist(), metrics["num-examples"], metrics["train_loss"], metrics["steps_per_second"]
    ([0.0, 1.0, 2.0], 8, 0.5, 4.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from ort_lightning.errors import DeviceReplyError
from ort_lightning.fleet.devices.frames import Result, decode_record, read_counts, read_result
from ort_lightning.fleet.devices.legacy_fit import masked_reply, stage_reply
from ort_lightning.fleet.devices.protocol import ARRAYS_KEY, METRICS_KEY, WEIGHT_KEY
from ort_lightning.fleet.devices.weight_order import WeightOrder

__all__ = ["Asked", "answer_content", "clipping_norm", "reply_metrics", "reply_records"]

_NO_WEIGHTS = np.empty(0, np.float32)


@dataclass(frozen=True)
class Asked:
    """What a frame asks of its device, for checking the answer (`Hub.send`).

    Attributes:
        given: the examples per epoch the device was given (or may claim, with the page's own data).
        last_epoch: the last epoch's steps (None: the page made its own batches and says).
        server_round: the round.
        stage: the SecAgg+ stage (None: a plain round).
        clip: the client-side DP clipping norm, if any.
        shapes: the legacy parameters' shapes, at SecAgg+'s collect stage.
    """

    given: int
    last_epoch: int | None
    server_round: int
    stage: str | None = None
    clip: float | None = None
    shapes: tuple[tuple[int, ...], ...] = ()


def answer_content(
    asked: Asked, header: dict[str, Any], payload: memoryview, weight_order: WeightOrder, *, device: str
) -> RecordDict:
    """A device's binary answer to `asked`, checked, as the content of Flower's reply.

    Raises:
        DeviceReplyError: for an answer that fails a check (its device is refused).
    """
    if asked.stage is None:
        result = read_result(header, payload, device=device, parameters=weight_order.size, given=asked.given,
                             stated=asked.last_epoch is None)
        arrays, trained = reply_records(result, header, weight_order, last_epoch=asked.last_epoch, clip=asked.clip,
                                        device=device)
        return RecordDict({ARRAYS_KEY: arrays, METRICS_KEY: trained})
    if header.get("type") != "secagg":
        raise DeviceReplyError(f"{device} answered SecAgg+'s {asked.stage} stage with a {header.get('type')!r} frame, "
                               "but a 'secagg' frame was expected; the device is refused (its page predates secure "
                               "aggregation: reload it from the fleet's URL).")
    record = decode_record(header.get("record"), payload, header.get("blobs"), device=device)
    if asked.stage != Stage.COLLECT_MASKED_VECTORS:
        return stage_reply(asked.stage, record, device=device)
    counts = read_counts(header, device=device, given=asked.given, stated=asked.last_epoch is None)
    metrics = reply_metrics(Result(_NO_WEIGHTS, *counts), header, last_epoch=asked.last_epoch, clip=asked.clip,
                            device=device)
    return masked_reply(record, asked.shapes, counts[0], metrics, device=device)


def _timings(header: dict[str, Any]) -> dict[str, float]:
    """The page's own timings: its local fit, its first step alone, opening its session (NaN when absent)."""
    names = {"fit_seconds": "seconds", "first_step_seconds": "first_step_seconds", "open_seconds": "open_seconds"}
    timings = {ours: float(v) if isinstance(v := header.get(theirs), (int, float)) else math.nan
               for ours, theirs in names.items()}
    # NOTE: a page's set-up is opening its session; the steps' rate is a simulated device's column too.
    timings["setup_seconds"] = timings["open_seconds"]
    return timings


def clipping_norm(message: Message) -> float | None:
    """The norm a device clips its update to: Flower's client-side DP wrappers put it in the train config."""
    config = message.content.config_records.get("config")
    # NOTE: "clipping_norm" is Flower's key (flwr.supercore.differential_privacy.KEY_CLIPPING_NORM).
    value = None if config is None else config.get("clipping_norm")
    return None if value is None else float(value)  # type: ignore[arg-type]


def _norm_bit(header: dict[str, Any], clip: float, device: str) -> int:
    """Flower's ``norm_bit`` (adaptive clipping): 1 where the device's update was above the norm and clipped."""
    norm = header.get("update_norm")
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not math.isfinite(norm):
        raise DeviceReplyError(f"{device} was asked to clip its update to norm {clip:g} but sent update_norm={norm!r}, "
                               "not the norm it clipped; the device is refused (use the fleet's page).")
    return int(norm > clip)


def reply_records(
    result: Result, header: dict[str, Any], weight_order: WeightOrder, *, last_epoch: int | None,
    clip: float | None = None, device: str = "the device",
) -> tuple[ArrayRecord, MetricRecord]:
    """The reply's arrays (named by `weight_order`) and metrics (`reply_metrics`).

    Raises:
        DeviceReplyError: a device asked to clip that sent no update norm.
    """
    metrics = reply_metrics(result, header, last_epoch=last_epoch, clip=clip, device=device)
    return weight_order.record(result.weights), MetricRecord(dict(metrics))


def reply_metrics(
    result: Result, header: dict[str, Any], *, last_epoch: int | None, clip: float | None = None,
    device: str = "the device",
) -> dict[str, int | float]:
    """The reply's metrics; `last_epoch`: its steps, else the device's count (a masked reply has no weights).

    With `clip` (client-side DP), the metrics hold Flower's ``norm_bit`` from the device's ``update_norm``.

    Raises:
        DeviceReplyError: a device asked to clip that sent no update norm.
    """
    steps = last_epoch if last_epoch is not None else result.last_epoch_steps
    last = result.losses[-steps:] if steps else []
    timings = _timings(header)
    rate = result.steps / timings["fit_seconds"] if timings["fit_seconds"] > 0 else math.nan
    metrics: dict[str, int | float] = {
        WEIGHT_KEY: result.examples, "train_loss": float(np.mean(last)) if last else math.nan,
        "steps": result.steps, "steps_per_second": rate, **timings,
    }
    if clip is not None:
        metrics["norm_bit"] = _norm_bit(header, clip, device)
    return metrics
