"""`OrtLoop`: a device's local training as a phone or a page runs it, ONNX Runtime's loop on the device folder.

Per batch one train step, one optimizer step and a gradient reset (``runner.js``'s loop, through
`ort_lightning.ort.on_device.OrtDevice`); each epoch iterates the ``DataLoader`` to its end, as
the browser engine does, so that a shuffling loader draws the same order on every runtime. ONNX
Runtime's objects are freed when the device replies.
"""

from __future__ import annotations

import functools
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError, NonFiniteLossError
from ort_lightning.fleet.devices.device_files import device_files, ordered
from ort_lightning.fleet.devices.exchange import Exchange
from ort_lightning.fleet.devices.protocol import Fit
from ort_lightning.fleet.devices.weight_order import WeightOrder
from ort_lightning.ort.on_device import DeviceFiles, OrtDevice

__all__ = ["OrtLoop"]


@dataclass(frozen=True)
class OrtLoop:
    """ONNX Runtime's device loop over one device folder's `files`, read once per process (`read`)."""

    files: DeviceFiles
    exchange: Exchange
    inputs: list[str]
    intra_op_threads: int = 1

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def read(artifacts: str, *, labels: tuple[str, ...] | None, start: str, intra_op_threads: int) -> OrtLoop:
        """The loop over the folder `artifacts` for devices that start as `start` (see `DeviceClient`)."""
        loaded = TrainingArtifacts.load(artifacts, labels=None if labels is None else list(labels))
        files = device_files(loaded, complete=complete_start(loaded, start))
        exchange = Exchange.of(loaded, WeightOrder.checked(loaded, files.training, files.checkpoint))
        return OrtLoop(files, exchange, [spec.name for spec in loaded.manifest.graph_inputs], intra_op_threads)

    def train(self, arrays: ArrayRecord, loader: Any, *, epochs: int, kept: Path | None, keep: bool) -> Fit:
        """Train the server's `arrays` for `epochs` epochs of `loader`, from the device's `kept` checkpoint if any."""
        device = self._open(arrays, checkpoint=kept)
        try:
            started = time.perf_counter()
            losses, examples = [], 0
            for _ in range(epochs):
                trained = device.train([ordered(batch, self.inputs) for batch in loader])
                losses.append(trained.losses)
                examples = trained.examples
            seconds = time.perf_counter() - started
            _check_finite(losses)
            values = self._sent(device)
            checkpoint = _saved(device) if keep else None
        finally:
            device.release()
        return Fit(values, examples, float(np.mean(losses[-1])), sum(map(len, losses)), started, seconds, checkpoint)

    def evaluate(self, arrays: ArrayRecord, loader: Any) -> Iterator[tuple[float, np.ndarray | None, np.ndarray]]:
        """Per batch of `loader`: the eval graph's loss and logits (None where it has none), and the labels."""
        device = self._open(arrays, evaluation=True)
        try:
            for batch in loader:
                tensors = ordered(batch, self.inputs)
                [(loss, logits)] = device.evaluate([tensors])
                yield loss, logits, np.asarray(tensors[-1])
        finally:
            device.release()

    def _open(self, arrays: ArrayRecord, **options: Any) -> OrtDevice:
        """A device over the folder's files with the server's `arrays` in place of the sent tensors."""
        exchange, sent = self.exchange, self.exchange.sent.flat(arrays)
        options["intra_op_threads"] = self.intra_op_threads
        if exchange.mode != "spans":
            return OrtDevice.open(self.files, weights=sent, trainable_only=exchange.mode == "trainable", **options)
        device = OrtDevice.open(self.files, **options)
        whole = device.get_weights()
        exchange.scatter(whole, sent)
        device.set_weights(whole)
        return device

    def _sent(self, device: OrtDevice) -> ArrayRecord:
        """The device's values of the sent tensors, as the reply's record."""
        exchange = self.exchange
        if exchange.mode == "spans":
            return exchange.sent.record(exchange.gather(device.get_weights()))
        return exchange.sent.record(device.get_weights(trainable_only=exchange.mode == "trainable"))


def complete_start(artifacts: TrainingArtifacts, start: str) -> bool:
    """Whether a device opens the complete checkpoint: ``"complete"``, or ``"auto"`` without a nominal one or frozen.

    Raises:
        ConfigurationError: for a start the folder cannot give.
    """
    frozen = _frozen_start(artifacts, start)
    if start == "nominal" and artifacts.nominal_checkpoint is None:
        raise ConfigurationError(
            f"start=\"nominal\" needs a nominal checkpoint in {artifacts.directory}, but it has none; export the "
            "artifacts with export_artifacts(..., nominal_checkpoint=True), or pass start=\"complete\"."
        )
    if start == "complete" and artifacts.weightless:
        raise ConfigurationError(
            f"start=\"complete\" needs the complete checkpoint in {artifacts.directory}, but the folder holds no "
            "weights (its only checkpoint is nominal_checkpoint, as a device receives it); pass start=\"nominal\" or "
            "\"auto\", or copy the complete checkpoint beside the graphs."
        )
    return start == "complete" or (start == "auto" and (artifacts.nominal_checkpoint is None or frozen))


def _frozen_start(artifacts: TrainingArtifacts, start: str) -> bool:
    """Whether `artifacts` freeze parameters, which a device can only read from the complete checkpoint.

    Raises:
        ConfigurationError: for a nominal start or a folder without the complete checkpoint.
    """
    frozen = artifacts.manifest.frozen
    if frozen and (start == "nominal" or artifacts.weightless):
        raise ConfigurationError(
            f"{artifacts.directory} freezes {len(frozen)} parameters ({frozen[0]}, ...), whose values a fleet never "
            "sends: a device reads them from the complete checkpoint once, but "
            + ("start=\"nominal\" opens the nominal one; pass start=\"auto\" or \"complete\"." if start == "nominal"
               else "the folder holds only the nominal checkpoint; copy the complete checkpoint beside the graphs.")
        )
    return bool(frozen)


def _check_finite(losses: list[list[float]]) -> None:
    """Refuse a round whose loss went NaN or infinite: its weights must not reach the strategy.

    Raises:
        NonFiniteLossError: naming the epoch and step (the device's error reply).
    """
    for epoch, epoch_losses in enumerate(losses, start=1):
        bad = next((step for step, loss in enumerate(epoch_losses, start=1) if not math.isfinite(loss)), None)
        if bad is not None:
            raise NonFiniteLossError(
                f"The device's training loss is {epoch_losses[bad - 1]} at step {bad} of local epoch {epoch}, so its "
                "weights are not sent; the round goes on without it (lower the lr, or check this device's data)."
            )


def _saved(device: OrtDevice) -> bytes:
    """The device's checkpoint with its optimizer state (step and moments), as the bytes its Context keeps."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-device-") as folder:
        return device.save(Path(folder) / "device.ortckpt").read_bytes()
