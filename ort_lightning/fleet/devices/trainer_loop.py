"""`TrainerLoop`: a device's local training as a ``lightning.Trainer`` fit (``runner: lightning``).

The server's values are loaded into the worker's module (one module and one ``Trainer`` per
worker process: `ort_lightning.fleet.devices.trainer_slots`), which fits `epochs` epochs at the
device folder's rate (`rate_options`) and hands its values back.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.fleet.devices.client import evaluation
from ort_lightning.fleet.devices.ort_loop import complete_start
from ort_lightning.fleet.devices.protocol import Fit
from ort_lightning.fleet.devices.state_values import sent_values, whole_values
from ort_lightning.fleet.devices.trainer_slots import WORKER, Slot, SlotKind
from ort_lightning.training.module import ORTLightningModule

__all__ = ["ORT_DEFAULT_LR", "TrainerLoop", "evaluate_module", "rate_options"]

#: The rate ONNX Runtime feeds an optimizer graph that no one gives another (a plain folder, on every runtime).
ORT_DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class TrainerLoop:
    """A Trainer's fit over the worker's module of `artifacts` (the options are `DeviceClient`'s).

    ``threads`` is ``"single"`` unless `module_options` say otherwise: a device's fit is a few
    batches, and a spinning pool costs more to build than it saves.
    """

    artifacts: str | os.PathLike[str]
    start: str = "auto"
    epochs: int = 1
    labels: tuple[str, ...] | None = None
    module_options: dict[str, Any] = field(default_factory=dict)
    trainer_options: dict[str, Any] = field(default_factory=dict)

    def train(self, arrays: ArrayRecord, loader: Any, *, epochs: int, kept: Path | None, keep: bool) -> Fit:
        """Fit the server's `arrays` on `loader`, from the device's `kept` ORT state if any."""
        values = arrays.to_torch_state_dict()
        with self._slot(values) as slot:
            # NOTE: a round trains and replies: ORT's objects, where rebuilt, are built without the eval graph.
            slot.module.load_values(whole_values(slot.module, values), optimizer_state=kept, evaluation=False)
            started = time.perf_counter()
            slot.fit(train_dataloaders=loader)
            seconds = time.perf_counter() - started
            loss = slot.trainer.callback_metrics.get("train_loss")
            return Fit(ArrayRecord(sent_values(slot.module)), len(loader.dataset),
                       float("nan") if loss is None else float(loss), int(slot.trainer.global_step), started, seconds,
                       _saved(slot.module) if keep else None)

    def evaluate(self, arrays: ArrayRecord, loader: Any) -> Iterator[tuple[float, np.ndarray | None, np.ndarray]]:
        """Per batch of `loader`: the eval graph's loss and logits, and the labels."""
        values = arrays.to_torch_state_dict()
        with self._slot(values) as slot:
            # NOTE: the eval graph reads the values only; the next device's load starts a fresh optimizer anyway.
            slot.module.set_values(whole_values(slot.module, values))
            yield from _batches(slot.module, loader)

    def _module_options(self, artifacts: TrainingArtifacts) -> dict[str, Any]:
        return {**rate_options(artifacts), "threads": "single", **self.module_options}

    def _slot(self, values: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[Slot]:
        """This worker's slot for these artifacts and options; the first device builds it with its `values`."""
        artifacts = _loaded(os.path.realpath(self.artifacts), self.labels)
        options, trainer_options = self._module_options(artifacts), self._trainer_options()
        kind = SlotKind.of(self.artifacts, start=self.start, module_options=options, trainer_options=trainer_options)

        def build() -> Slot:
            complete = complete_start(artifacts, self.start)
            # NOTE: a folder with frozen parameters starts from the complete checkpoint; the values sent are a part.
            whole = None if artifacts.manifest.frozen else values
            module = ORTLightningModule(artifacts, checkpoint=None if complete else artifacts.nominal_checkpoint,
                                        values=whole, **options)
            return Slot(module, pl.Trainer(**trainer_options))

        return WORKER.slot(kind, build)

    def _trainer_options(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, **self.trainer_options,
            "max_epochs": self.epochs,
        }


def rate_options(artifacts: TrainingArtifacts) -> dict[str, Any]:
    """The `ORTLightningModule` options that train at the folder's rate: its optimizer graph's, else ORT's default."""
    schedule = artifacts.manifest.lr_schedule
    if schedule is None:
        return {"lr": ORT_DEFAULT_LR, "lr_scheduler": "constant"}
    if schedule.kind == "constant":
        return {"lr": schedule.lr, "lr_scheduler": "constant"}
    return {"lr": schedule.lr, "lr_scheduler": "linear", "warmup_steps": schedule.warmup_steps,
            "total_steps": schedule.total_steps}


@functools.lru_cache(maxsize=4)
def _loaded(artifacts: str, labels: tuple[str, ...] | None) -> TrainingArtifacts:
    return TrainingArtifacts.load(artifacts, labels=None if labels is None else list(labels))


def _saved(module: ORTLightningModule) -> bytes:
    """The device's ORT state with its optimizer step and moments, as the bytes its Context keeps."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-fleet-") as folder:
        return module.save_ort_checkpoint(Path(folder) / "client.ortckpt", include_optimizer_state=True).read_bytes()


@torch.no_grad()
def _batches(module: ORTLightningModule, loader: DataLoader) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
    for batch in loader:
        inputs, labels = batch[:-1], batch[-1]
        loss, logits = module.evaluate_batch([*inputs, labels])
        yield float(loss), logits.numpy(), labels.numpy()


def evaluate_module(module: ORTLightningModule, loader: DataLoader) -> dict[str, float]:
    """Loss and accuracy of the module's eval graph over `loader` per sample, or per token (see `evaluation`).

    Returns:
        ``{"loss": ..., "accuracy": ..., "examples": n}``; a language model's ``perplexity`` and ``tokens``
        in place of ``accuracy``.
    """
    return evaluation(_batches(module, loader))
