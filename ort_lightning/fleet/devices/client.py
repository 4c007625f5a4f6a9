"""`DeviceClient`: the one Flower client every fleet device runs, on every engine (docs/fleets.md).

A ``train`` message's global values are trained `epochs` local epochs on the device's partition
by its runner's loop: ONNX Runtime's device loop (`OrtLoop`, the default, what a phone or a page
runs) or a Trainer (`TrainerLoop`, imported only for ``runner="lightning"``: a device imports no
Lightning). ``evaluate`` runs the eval graph on the device's test data.

The learning rate has one route: the device folder's optimizer graph, which `prepare_for_web`
writes once from the config's ``lr``. onnxruntime-web cannot set a rate, so a page can only read
it there, and every other runtime reads it there too: no runtime is told a rate the others miss.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.clipping import clip_when_asked
from ort_lightning.fleet.devices.ort_loop import OrtLoop
from ort_lightning.fleet.devices.protocol import (
    ARRAYS_KEY,
    METRICS_KEY,
    RUNNERS,
    WEIGHT_KEY,
    ClientData,
    DataFn,
    Loop,
    check_client_options,
)
from ort_lightning.fleet.devices.scores import Scores

__all__ = ["DeviceClient", "evaluation"]

#: Where a device keeps its checkpoint between rounds (``optimizer_state="keep"``).
_STATE_KEY = "ort_lightning_device_checkpoint"


@dataclass(frozen=True)
class DeviceClient:
    """What every fleet device runs (see the module docstring).

    Args:
        artifacts: the device folder (``prepare_for_web``'s; a plain one trains at ORT's default 1e-3).
        data: ``(partition_id, num_partitions) -> ClientData``, picklable for Flower's Ray simulation.
        epochs: local epochs per round.
        runner: ``"ort"`` (ONNX Runtime's device loop) or ``"lightning"`` (a Trainer).
        optimizer_state: ``"fresh"`` (step 0 every round) or ``"keep"`` (the device's checkpoint stays in
            its ``Context.state`` between rounds).
        start: ``"nominal"`` (the nominal checkpoint plus the server's values), ``"complete"`` or ``"auto"``.
        labels: the training graph's label inputs, where the folder cannot tell.
        intra_op_threads: ORT's intra-op threads per ``"ort"`` device (one, as a page; 0: ORT's pool).
        module_options: other `ORTLightningModule` options (``"lightning"`` only).
        trainer_options: `lightning.Trainer` options (``"lightning"`` only).
        mods: Flower client mods around each message (``ClientApp(mods=...)``).

    Raises:
        ConfigurationError: for an unknown option, `epochs` < 1, or Trainer options for ``"ort"``.
    """

    artifacts: str | os.PathLike[str]
    data: DataFn
    epochs: int = 1
    runner: str = "ort"
    optimizer_state: str = "fresh"
    start: str = "auto"
    labels: tuple[str, ...] | None = None
    intra_op_threads: int = 1
    module_options: dict[str, Any] = field(default_factory=dict)
    trainer_options: dict[str, Any] = field(default_factory=dict)
    mods: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        check_client_options(self.optimizer_state, self.start, self.epochs)
        if self.runner not in RUNNERS:
            raise ConfigurationError(f"Expected `runner` to be one of {RUNNERS}, but got {self.runner!r}; pass \"ort\" "
                                     "(ONNX Runtime's device loop, what a device runs) or \"lightning\" (a Trainer).")
        if self.runner == "ort" and (self.module_options or self.trainer_options):
            raise ConfigurationError(
                "module_options and trainer_options configure the Trainer of runner=\"lightning\", but this client "
                "runs ONNX Runtime's device loop (runner=\"ort\"); pass runner=\"lightning\", or leave them out."
            )

    def client_app(self, *, mods: list[Any] | None = None) -> ClientApp:
        """A Flower ``ClientApp`` with ``train`` and ``evaluate`` handlers under `clip_when_asked`, then `mods`."""
        app = ClientApp(mods=[clip_when_asked, *self.mods, *(mods or [])])
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        return app

    def loop(self) -> Loop:
        """The runner's loop over the folder (ONNX Runtime's is read once per process and options)."""
        if self.runner == "lightning":
            from ort_lightning.fleet.devices.trainer_loop import (
                TrainerLoop,  # Lightning, for the runner that asks for it
            )

            return TrainerLoop(self.artifacts, start=self.start, epochs=self.epochs, labels=self.labels,
                               module_options=self.module_options, trainer_options=self.trainer_options)
        return OrtLoop.read(os.path.realpath(self.artifacts), labels=self.labels, start=self.start,
                            intra_op_threads=self.intra_op_threads)

    # ----------------------------------------------------------------------------- handlers
    def train(self, message: Message, context: Context) -> Message:
        """Train the global values for `epochs` local epochs; reply with the new values and the metrics."""
        entered = time.perf_counter()
        data = self._data(context)
        keep = self.optimizer_state == "keep"
        with self._kept(context) as kept:
            fit = self.loop().train(message.content.array_records[ARRAYS_KEY], data.train, epochs=self.epochs,
                                    kept=kept, keep=keep)
        if fit.checkpoint is not None:
            context.state[_STATE_KEY] = ArrayRecord(
                {"checkpoint": torch.frombuffer(bytearray(fit.checkpoint), dtype=torch.uint8)})
        metrics: dict[str, Any] = {
            WEIGHT_KEY: fit.examples, "train_loss": fit.loss, "steps": fit.steps,
            "setup_seconds": fit.started - entered, "fit_seconds": fit.seconds,
            "steps_per_second": fit.steps / fit.seconds if fit.seconds > 0 else math.nan,
        }
        return Message(RecordDict({ARRAYS_KEY: fit.values, METRICS_KEY: MetricRecord(metrics)}), reply_to=message)

    def evaluate(self, message: Message, context: Context) -> Message:
        """Run the eval graph on the device's test data with the global values; reply with its scores (`Scores`)."""
        data = self._data(context)
        if data.test is None:
            raise ConfigurationError(
                "This device has no test data (ClientData.test is None) but was asked to evaluate; return test "
                "batches from `data`, or set the strategy's fraction_evaluate=0."
            )
        result = evaluation(self.loop().evaluate(message.content.array_records[ARRAYS_KEY], data.test))
        metrics: dict[str, Any] = {WEIGHT_KEY: result["examples"], **{f"eval_{key}": value for key, value
                                                                       in result.items() if key != "examples"}}
        return Message(RecordDict({METRICS_KEY: MetricRecord(metrics)}), reply_to=message)

    # ----------------------------------------------------------------------------- helpers
    def _data(self, context: Context) -> ClientData:
        config = context.node_config
        return self.data(int(config["partition-id"]), int(config["num-partitions"]))

    @contextlib.contextmanager
    def _kept(self, context: Context) -> Iterator[Path | None]:
        """The device's own checkpoint under ``"keep"`` once it has one, as a file; else None (a fresh device)."""
        stored = context.state.array_records.get(_STATE_KEY) if self.optimizer_state == "keep" else None
        if stored is None:
            yield None
            return
        with tempfile.TemporaryDirectory(prefix="ort-lightning-device-") as folder:
            path = Path(folder) / "device.ortckpt"
            path.write_bytes(stored["checkpoint"].numpy().tobytes())
            yield path


def evaluation(batches: Iterable[tuple[float, np.ndarray | None, np.ndarray]]) -> dict[str, float]:
    """Loss and accuracy per sample, or a language model's loss and perplexity per token (`Scores`).

    Raises:
        ConfigurationError: for empty data.
    """
    scores = Scores()
    for loss, logits, labels in batches:
        scores.add(loss, logits, labels)
    return scores.result()
