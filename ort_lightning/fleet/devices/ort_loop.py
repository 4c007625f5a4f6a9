"""`DeviceClient`: a simulated device that runs what a real device runs, ONNX Runtime's loop on the device folder.

Each ``train`` message carries the global values (an ``ArrayRecord`` keyed by state tensor
name). The device opens the device folder's files as a phone or a page opens them
(`ort_lightning.ort.on_device.OrtDevice`: the ``.ort`` graphs where present, the nominal
checkpoint plus the server's values as one float32 buffer), trains `epochs` local epochs (per
batch one train step, one optimizer step and a gradient reset, ``runner.js``'s loop), and
replies with its values (a loss that turns NaN or infinite is an error reply instead, as a
module's ``on_nonfinite="raise"`` makes it) and ``num-examples`` (its training set's size: FedAvg's weight),
``train_loss`` (the mean of the last epoch's losses, as a page reports it), ``steps``,
``setup_seconds`` (from the handler's start to the first step: the data, the values, opening
the device), ``fit_seconds`` (the training loop) and ``steps_per_second``. ``evaluate``
messages run the eval graph on the device's test data.

Each epoch iterates the device's ``DataLoader`` to its end, as the browser fleet's server does
when it ships a page its batches: a shuffling loader then draws the same order on every
runtime. (A ``lightning.Trainer`` stops an epoch after ``len(loader)`` batches, before
torch's ``RandomSampler`` draws its last permutation, so that a Lightning device's second epoch
shuffles differently: `FleetClient` is not what a device runs.)

The rate is the one the folder's optimizer graph computes (``prepare_for_web``), or `lr` set
through ONNX Runtime's ``set_learning_rate`` on a plain folder (ORT's default 1e-3 without one).

Optimizer state, as a device handles it (`DeviceClient.optimizer_state`):

- ``"fresh"`` (default): every round opens a new device (step 0, no moments).
- ``"keep"``: the device saves its checkpoint with its optimizer state at the end of a round
  (in its Flower ``Context.state``: it never leaves the device) and opens it next round, so that
  its step and AdamW moments continue, and so does a schedule computed from the step.

Nothing of one device stays in the process after its round: ONNX Runtime's objects are freed
when it replies.

Example::

    >>> import tempfile, torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from ort_lightning import export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(),
    ...                              nominal_checkpoint=True, verify=False)
    >>> def data(partition: int, partitions: int) -> ClientData:
    ...     x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ...     return ClientData(train=DataLoader(TensorDataset(x, y), batch_size=4))
    >>> client = DeviceClient(artifacts.directory, data, epochs=2, lr=0.1)
    >>> app = client.client_app()
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError, NonFiniteLossError
from ort_lightning.fleet.devices.device_files import device_files, ordered, weight_order
from ort_lightning.fleet.devices.protocol import (
    ARRAYS_KEY,
    METRICS_KEY,
    WEIGHT_KEY,
    ClientData,
    DataFn,
    check_client_options,
)
from ort_lightning.fleet.devices.weights import WeightLayout
from ort_lightning.ort.on_device import DeviceFiles, OrtDevice

__all__ = ["DeviceClient", "DeviceFolder"]

#: Where a device keeps its checkpoint between rounds (``optimizer_state="keep"``).
_STATE_KEY = "ort_lightning_device_checkpoint"


@dataclass(frozen=True)
class DeviceFolder:
    """What every device of a process reads from the folder once: its files, the flat weights' order, the rate.

    Attributes:
        files: what a device opens.
        order: ``(name, shape)`` of every state tensor, in the flat buffer's order.
        inputs: the training graph's input names (a dict batch is ordered by them).
        lr: the rate a device sets, or None where the optimizer graph computes its own.
    """

    files: DeviceFiles
    order: list[tuple[str, tuple[int, ...]]]
    inputs: list[str]
    lr: float | None

    @classmethod
    def read(cls, artifacts: TrainingArtifacts, *, start: str, lr: float | None) -> DeviceFolder:
        """Read the folder for devices that start as `start` (see `DeviceClient`) at `lr`.

        Raises:
            ConfigurationError: for a start the folder cannot give, or an `lr` its optimizer graph ignores.
        """
        files = device_files(artifacts, complete=_complete(artifacts, start))
        schedule = artifacts.manifest.lr_schedule
        if schedule is not None and lr is not None and (schedule.kind, schedule.lr) != ("constant", lr):
            raise ConfigurationError(
                f"The device folder {artifacts.directory} computes its own rate ({schedule.describe()}), so a device "
                f"cannot train it at lr={lr}; pass lr=None to train at the folder's rate, or prepare the folder again "
                "with prepare_for_web(..., lr=...)."
            )
        inputs = [spec.name for spec in artifacts.manifest.graph_inputs]
        return cls(files, weight_order(artifacts, files), inputs, None if schedule is not None else lr)

    @functools.cached_property
    def layout(self) -> WeightLayout:
        """The flat buffer's tensors: the server's values in, the device's values out."""
        return WeightLayout(self.order)


def _complete(artifacts: TrainingArtifacts, start: str) -> bool:
    """Whether devices open the complete checkpoint (`start` ``"complete"``, or ``"auto"`` without a nominal one)."""
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
    return start == "complete" or (start == "auto" and artifacts.nominal_checkpoint is None)


@functools.lru_cache(maxsize=4)
def _folder(artifacts: str, labels: tuple[str, ...] | None, start: str, lr: float | None) -> DeviceFolder:
    """A process's `DeviceFolder` per folder and options: read once, not once per device."""
    loaded = TrainingArtifacts.load(artifacts, labels=None if labels is None else list(labels))
    return DeviceFolder.read(loaded, start=start, lr=lr)


@dataclass(frozen=True)
class DeviceClient:
    """What every simulated device runs: ONNX Runtime's device loop on the device folder (see the module docstring).

    Args:
        artifacts: the device folder (``export_artifacts(..., nominal_checkpoint=True)``, ideally
            ``ort_format=True``; or a ``prepare_for_web`` folder, the very files a browser loads).
        data: ``(partition_id, num_partitions) -> ClientData``; it must pickle (a top-level function
            or a `functools.partial` of one) for Flower's Ray simulation.
        epochs: local epochs per round.
        lr: the rate a device sets on a plain folder; None trains at the rate the optimizer graph
            computes (a ``prepare_for_web`` folder) or holds (1e-3).
        optimizer_state: ``"fresh"`` or ``"keep"`` (see the module docstring).
        start: ``"auto"``, ``"nominal"`` (the nominal checkpoint plus the server's values) or
            ``"complete"`` (the complete checkpoint, whose weights the server's values replace).
        labels: the training graph's label inputs, where the folder cannot tell (see `TrainingArtifacts.load`).
        intra_op_threads: ONNX Runtime's intra-op threads per device: one, as a page runs it (see
            `ort_lightning.ort.on_device`); 0 for ORT's default pool.

    Raises:
        ConfigurationError: for an unknown `optimizer_state` or `start`, or a non-positive `epochs`.
    """

    artifacts: str | os.PathLike[str]
    data: DataFn
    epochs: int = 1
    lr: float | None = None
    optimizer_state: str = "fresh"
    start: str = "auto"
    labels: tuple[str, ...] | None = None
    intra_op_threads: int = 1

    def __post_init__(self) -> None:
        check_client_options(self.optimizer_state, self.start, self.epochs)

    def client_app(self, *, mods: list[Any] | None = None) -> ClientApp:
        """A Flower ``ClientApp`` with ``train`` and ``evaluate`` handlers (and Flower `mods`, if any)."""
        app = ClientApp(mods=mods)
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        return app

    def folder(self) -> DeviceFolder:
        """The device folder as this process read it (once per folder and options)."""
        return _folder(os.path.realpath(self.artifacts), self.labels, self.start, self.lr)

    # ----------------------------------------------------------------------------- handlers
    def train(self, message: Message, context: Context) -> Message:
        """Train the global values for `epochs` local epochs; reply with the new values and the metrics."""
        entered = time.perf_counter()
        data = self._data(context)
        folder = self.folder()
        weights = folder.layout.flat(message.content.array_records[ARRAYS_KEY])
        with self._kept(context) as kept:
            device = OrtDevice.open(folder.files, weights=weights, checkpoint=kept, lr=folder.lr,
                                    intra_op_threads=self.intra_op_threads)
        try:
            started = time.perf_counter()
            losses, examples = [], 0
            for _ in range(self.epochs):
                trained = device.train([ordered(batch, folder.inputs) for batch in data.train])
                losses.append(trained.losses)
                examples = trained.examples
            seconds = time.perf_counter() - started
            _check_finite(losses)
            values = folder.layout.record(device.get_weights())
            if self.optimizer_state == "keep":
                context.state[_STATE_KEY] = _saved(device)
        finally:
            device.release()
        steps = sum(map(len, losses))
        metrics: dict[str, Any] = {
            WEIGHT_KEY: examples, "train_loss": float(np.mean(losses[-1])), "steps": steps,
            "setup_seconds": started - entered, "fit_seconds": seconds,
            "steps_per_second": steps / seconds if seconds > 0 else math.nan,
        }
        return Message(RecordDict({ARRAYS_KEY: values, METRICS_KEY: MetricRecord(metrics)}),
                       reply_to=message)

    def evaluate(self, message: Message, context: Context) -> Message:
        """Run the eval graph on the device's test data with the global values; reply with loss and accuracy."""
        data = self._data(context)
        if data.test is None:
            raise ConfigurationError(
                "This device has no test data (ClientData.test is None) but was asked to evaluate; return test "
                "batches from `data`, or set the strategy's fraction_evaluate=0."
            )
        folder = self.folder()
        device = OrtDevice.open(folder.files, weights=folder.layout.flat(message.content.array_records[ARRAYS_KEY]),
                                evaluation=True, intra_op_threads=self.intra_op_threads)
        try:
            result = evaluate_device(device, data.test, folder.inputs)
        finally:
            device.release()
        metrics: dict[str, Any] = {
            WEIGHT_KEY: result["examples"], "eval_loss": result["loss"], "eval_accuracy": result["accuracy"]
        }
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


def _check_finite(losses: list[list[float]]) -> None:
    """Refuse a round whose loss went NaN or infinite: its weights must not reach the strategy.

    Raises:
        NonFiniteLossError: naming the epoch and step (the device's error reply; the round aggregates the others).
    """
    for epoch, epoch_losses in enumerate(losses, start=1):
        bad = next((step for step, loss in enumerate(epoch_losses, start=1) if not math.isfinite(loss)), None)
        if bad is not None:
            raise NonFiniteLossError(
                f"The device's training loss is {epoch_losses[bad - 1]} at step {bad} of local epoch {epoch}, so its "
                "weights are not sent; the round goes on without it (lower the lr, or check this device's data)."
            )


def _saved(device: OrtDevice) -> ArrayRecord:
    """The device's checkpoint with its optimizer state, as bytes a Flower Context keeps."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-device-") as folder:
        data = device.save(Path(folder) / "device.ortckpt").read_bytes()
    return ArrayRecord({"checkpoint": torch.frombuffer(bytearray(data), dtype=torch.uint8)})


def evaluate_device(device: OrtDevice, loader: Any, inputs: Sequence[str]) -> dict[str, float]:
    """Loss and accuracy of the device's eval graph over `loader`, averaged over samples.

    The accuracy compares the argmax along axis 1 of the eval graph's first model output (the
    logits) with the last input (the labels).

    Raises:
        ConfigurationError: for empty data.
    """
    total_loss = correct = seen = 0.0
    for batch in loader:
        tensors = ordered(batch, inputs)
        [(loss, logits)] = device.evaluate([tensors])
        labels = np.asarray(tensors[-1])
        size = labels.shape[0]
        total_loss += loss * size
        if logits is not None:
            correct += float((logits.argmax(axis=1) == labels).sum())
        seen += size
    if not seen:
        raise ConfigurationError("The evaluation data is empty; give every evaluating device at least one sample.")
    return {"loss": total_loss / seen, "accuracy": correct / seen, "examples": int(seen)}

