"""A Flower ``ClientApp`` that trains the artifacts with a ``lightning.Trainer``, as a device trains them.

Each ``train`` message carries the global values (an ``ArrayRecord`` keyed by state tensor
name, in the training graph's order). The client loads those values into its worker's
`ORTLightningModule` of the artifacts (one module and one ``Trainer`` per worker process, shared
by the devices it runs one after another: `ort_lightning.fleet.devices.trainer_slots`), fits `epochs` local
epochs on its own data, and replies with its values, ``num-examples`` (the size of its training
set: FedAvg's weight), ``train_loss``, ``setup_seconds`` (from the handler's start to the fit's)
and ``fit_seconds`` (the wall time of its fit). ``evaluate`` messages run the eval graph on the
client's test data and reply with ``eval_loss``, ``eval_accuracy`` and ``num-examples``.

Where a device starts (`FleetClient.start`), as ONNX Runtime runs a device:

- ``"nominal"``: from the artifacts' nominal checkpoint (names and shapes, no weights:
  ``export_artifacts(..., nominal_checkpoint=True)``) plus the server's values, ONNX Runtime's
  sequence for a device that receives its weights: ``CheckpointState.load_checkpoint(nominal)``,
  ``Module(...)``, ``Module.copy_buffer_to_parameters(values)``, then the ``Optimizer``. The
  device never reads weights from its own folder.
- ``"complete"``: from the artifacts' complete checkpoint, whose weights the server's values replace.
- ``"auto"`` (default): ``"nominal"`` when the folder has a nominal checkpoint, else ``"complete"``.

A device folder holds the graphs and the nominal checkpoint only, no weights (`TrainingArtifacts.weightless`:
the complete checkpoint stays with the server); it starts ``"nominal"``, as ``"auto"`` chooses.

Both give the same numbers; the nominal start is what a device that ships without weights runs.

Optimizer state, as a device would handle it (`FleetClient.optimizer_state`):

- ``"fresh"`` (default): every round starts ORT's optimizer anew (step 0, no moments) from the
  global weights; a learning rate schedule then counts this round's local steps.
- ``"keep"``: the client keeps its ORT optimizer state (step and AdamW moments) between rounds
  in its Flower ``Context.state`` (it never leaves the client); a schedule counts every local
  step the client has made since its first round.

Example::

    >>> import tempfile, torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from ort_lightning import export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> def data(partition: int, partitions: int) -> ClientData:
    ...     x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ...     return ClientData(train=DataLoader(TensorDataset(x, y), batch_size=4))
    >>> client = FleetClient(artifacts.directory, data, epochs=1, lr=0.1)
    >>> app = client.client_app()
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.protocol import (  # the protocol's names, still importable from here
    ARRAYS_KEY,
    METRICS_KEY,
    OPTIMIZER_STATES,
    STARTS,
    WEIGHT_KEY,
    ClientData,
    DataFn,
    check_client_options,
)
from ort_lightning.fleet.devices.state_values import get_values, set_values
from ort_lightning.fleet.devices.trainer_slots import WORKER, Slot, SlotKind
from ort_lightning.training.module import ORTLightningModule

__all__ = [
    "ARRAYS_KEY", "METRICS_KEY", "OPTIMIZER_STATES", "STARTS", "WEIGHT_KEY", "ClientData", "FleetClient",
    "check_client_options", "evaluate_module",
]

#: Where a client keeps its ORT optimizer state between rounds (``optimizer_state="keep"``).
_STATE_KEY = "ort_lightning_state"


@dataclass(frozen=True)
class FleetClient:
    """What every simulated device runs: its data, the local epochs, the module's options.

    Args:
        artifacts: the artifacts folder (the same files every device trains).
        data: ``(partition_id, num_partitions) -> ClientData``; it must pickle (a top-level
            function or a `functools.partial` of one) for Flower's Ray simulation.
        epochs: local epochs per round.
        lr: the module's peak learning rate.
        lr_scheduler: the module's ``lr_scheduler`` (``"constant"`` by default: a fleet usually
            sets its learning rate per round).
        optimizer_state: ``"fresh"`` or ``"keep"`` (see the module docstring).
        start: ``"auto"``, ``"nominal"`` or ``"complete"`` (see the module docstring).
        module_options: other `ORTLightningModule` options (``warmup_steps``, ``total_steps``, ...);
            ``threads`` is ``"single"`` unless given (ORT on one thread that does not spin: a
            device's fit is a few batches, and a spinning pool costs more to build than it saves).
        trainer_options: `lightning.Trainer` options replacing the quiet CPU defaults.

    Raises:
        ConfigurationError: for an unknown `optimizer_state` or `start`, or a non-positive `epochs`.
    """

    artifacts: str | os.PathLike[str]
    data: DataFn
    epochs: int = 1
    lr: float = 1e-3
    lr_scheduler: Any = "constant"
    optimizer_state: str = "fresh"
    start: str = "auto"
    module_options: dict[str, Any] = field(default_factory=dict)
    trainer_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_client_options(self.optimizer_state, self.start, self.epochs)

    def client_app(self, *, mods: list[Any] | None = None) -> ClientApp:
        """A Flower ``ClientApp`` with ``train`` and ``evaluate`` handlers (and Flower `mods`, if any)."""
        app = ClientApp(mods=mods)
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        return app

    # ----------------------------------------------------------------------------- handlers
    def train(self, message: Message, context: Context) -> Message:
        """Fit the global values for `epochs` local epochs; reply with the new values and the example count.

        The metrics carry ``setup_seconds`` (from the handler's start to the fit's) and ``fit_seconds``.
        """
        entered = time.perf_counter()
        data = self._data(context)
        values = message.content.array_records[ARRAYS_KEY].to_torch_state_dict()
        with self._slot(values) as slot, self._kept(context) as kept:
            # NOTE: a round trains and replies: ORT's objects, where rebuilt, are built without the eval graph.
            slot.module.load_values(values, optimizer_state=kept, evaluation=False)
            started = time.perf_counter()
            slot.fit(train_dataloaders=data.train)
            seconds = time.perf_counter() - started
            if self.optimizer_state == "keep":
                context.state[_STATE_KEY] = _kept_state(slot.module)
            loss = slot.trainer.callback_metrics.get("train_loss")
            metrics: dict[str, Any] = {
                WEIGHT_KEY: _examples(data.train), "train_loss": float("nan") if loss is None else float(loss),
                "fit_seconds": seconds, "setup_seconds": started - entered,
            }
            reply = RecordDict({ARRAYS_KEY: ArrayRecord(get_values(slot.module)), METRICS_KEY: MetricRecord(metrics)})
        return Message(reply, reply_to=message)

    def evaluate(self, message: Message, context: Context) -> Message:
        """Run the eval graph on the client's test data with the global values; reply with loss and accuracy."""
        data = self._data(context)
        if data.test is None:
            raise ConfigurationError(
                "This client has no test data (ClientData.test is None) but was asked to evaluate; return test "
                "batches from `data`, or set the strategy's fraction_evaluate=0."
            )
        values = message.content.array_records[ARRAYS_KEY].to_torch_state_dict()
        with self._slot(values) as slot:
            # NOTE: the eval graph reads the values only; the next device's load starts a fresh optimizer anyway.
            set_values(slot.module, values)
            result = evaluate_module(slot.module, data.test)
        metrics: dict[str, Any] = {
            WEIGHT_KEY: result["examples"], "eval_loss": result["loss"], "eval_accuracy": result["accuracy"]
        }
        return Message(RecordDict({METRICS_KEY: MetricRecord(metrics)}), reply_to=message)

    # ----------------------------------------------------------------------------- helpers
    def _data(self, context: Context) -> ClientData:
        config = context.node_config
        return self.data(int(config["partition-id"]), int(config["num-partitions"]))

    def _artifacts(self) -> TrainingArtifacts:
        return TrainingArtifacts.load(self.artifacts, labels=self.module_options.get("labels"))

    def _module_options(self) -> dict[str, Any]:
        # NOTE: threads="single" unless the options say otherwise: a worker runs many fits of a few batches,
        # where building ORT's spinning two-thread pool for each device cost ~10x the set-up of one thread.
        return {"lr": self.lr, "lr_scheduler": self.lr_scheduler, "threads": "single", **self.module_options}

    def _start(self, artifacts: TrainingArtifacts | None = None) -> Path | None:
        """The checkpoint a device starts from: the nominal one, or None for the complete one.

        Raises:
            ConfigurationError: for ``start="nominal"`` on a folder without a nominal checkpoint, or
                ``start="complete"`` on one without weights (a device folder).
        """
        artifacts = artifacts or self._artifacts()
        if self.start == "complete":
            if artifacts.weightless:
                raise ConfigurationError(
                    f"FleetClient(start=\"complete\") needs the complete checkpoint in {self.artifacts}, but the "
                    "folder holds no weights (its only checkpoint is nominal_checkpoint, as a device receives it); "
                    "pass start=\"nominal\" or \"auto\", or copy the complete checkpoint beside the graphs."
                )
            return None
        nominal = artifacts.nominal_checkpoint
        if nominal is None and self.start == "nominal":
            raise ConfigurationError(
                f"FleetClient(start=\"nominal\") needs a nominal checkpoint in {self.artifacts}, but it has none; "
                "export the artifacts with export_artifacts(..., nominal_checkpoint=True), or pass start=\"complete\"."
            )
        return nominal

    def _slot(self, values: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[Slot]:
        """This worker's slot for these artifacts and options; the first device builds it with its `values`.

        See `ort_lightning.fleet.devices.trainer_slots`.
        """
        trainer_options = self._trainer_options()
        kind = SlotKind.of(self.artifacts, start=self.start, module_options=self._module_options(),
                           trainer_options=trainer_options)

        def build() -> Slot:
            artifacts = self._artifacts()
            module = ORTLightningModule(artifacts, checkpoint=self._start(artifacts), values=values,
                                        **self._module_options())
            return Slot(module, pl.Trainer(**trainer_options))

        return WORKER.slot(kind, build)

    @contextlib.contextmanager
    def _kept(self, context: Context) -> Iterator[Path | None]:
        """The file of the client's kept ORT state under ``"keep"`` once it has one; else None (a fresh state)."""
        stored = context.state.array_records.get(_STATE_KEY) if self.optimizer_state == "keep" else None
        if stored is None:
            yield None
            return
        with tempfile.TemporaryDirectory(prefix="ort-lightning-fleet-") as folder:
            path = Path(folder) / "client.ortckpt"
            path.write_bytes(stored.to_torch_state_dict()["checkpoint"].numpy().tobytes())
            yield path

    def _trainer_options(self) -> dict[str, Any]:
        return {
            "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, **self.trainer_options,
            "max_epochs": self.epochs,
        }


def _kept_state(module: ORTLightningModule) -> ArrayRecord:
    """The device's ORT state with its optimizer step and moments, and its own step count as properties."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-fleet-") as folder:
        path = module.save_ort_checkpoint(Path(folder) / "client.ortckpt", include_optimizer_state=True)
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    return ArrayRecord({"checkpoint": data})


def _examples(loader: DataLoader) -> int:
    return len(loader.dataset)  # type: ignore[arg-type]


@torch.no_grad()
def evaluate_module(module: ORTLightningModule, loader: DataLoader) -> dict[str, float]:
    """Loss and accuracy of the eval graph over `loader`, averaged over samples.

    The loss is the eval graph's own (its first output); the accuracy compares the argmax of its
    first model output (the logits) along axis 1 with the labels.

    Returns:
        ``{"loss": ..., "accuracy": ..., "examples": n}``.
    """
    total_loss = correct = seen = 0.0
    for batch in loader:
        inputs, labels = batch[:-1], batch[-1]
        loss, logits = module.evaluate_batch([*inputs, labels])
        size = labels.shape[0]
        total_loss += float(loss) * size
        correct += float((logits.argmax(dim=1) == labels).sum())
        seen += size
    if not seen:
        raise ConfigurationError("The evaluation data is empty; give every evaluating client at least one sample.")
    return {"loss": total_loss / seen, "accuracy": correct / seen, "examples": int(seen)}
