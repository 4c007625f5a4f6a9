"""`ORTLightningModule`: a LightningModule whose forward, backward and update run in ONNX Runtime.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts, lr=0.01)
    >>> sorted(name for name, _ in module.named_parameters())
    ['bias', 'weight']
    >>> module(torch.zeros(5, 4)).shape
    torch.Size([5, 3])
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.runtime import SessionSettings
from ort_lightning.strategies import check_strategy
from ort_lightning.training.checkpointing.checkpoint_files import RunOrigin, read_checkpoint_state
from ort_lightning.training.checkpointing.connector import CheckpointConnector, RunState
from ort_lightning.training.checkpointing.io import install_atomic_io
from ort_lightning.training.checkpointing.methods import CheckpointHooks
from ort_lightning.training.guards import check_precision, check_torch_parameters, label_range_of, updated_parameters
from ort_lightning.training.metrics import stage_metrics_for
from ort_lightning.training.optim import hybrid as _hybrid
from ort_lightning.training.optim.configure import configure
from ort_lightning.training.optim.graph_schedule import module_schedule
from ort_lightning.training.optim.ort_optimizer import LinearLRSchedule
from ort_lightning.training.optim.schedules import (
    SchedulerFactory,
    check_lr_scheduler,
    check_not_finished,
    describe,
    planned_schedule_properties,
    total_steps_of,
)
from ort_lightning.training.session.evaluation import EvaluationHooks, ModuleEvaluation
from ort_lightning.training.session.live import LiveSession
from ort_lightning.training.session.session_views import DEVICE_KEY, state_values
from ort_lightning.training.session.step import NonFiniteGuard, StepPath
from ort_lightning.training.threads.policy import ThreadPolicy

__all__ = ["ORTLightningModule"]

#: What a pickle of the module leaves out: ORT's objects (they do not pickle) and what holds them.
_UNPICKLED = ("_live", "checkpointing", "evaluation")

#: Where a module's pickle keeps where its run stands (`RunState`: no ORT object).
_RUN_KEY = "_ort_run"


def _device_string(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


class ORTLightningModule(CheckpointHooks, EvaluationHooks):
    """Train ONNX Runtime training artifacts with an ordinary ``lightning.Trainer``.

    ``named_parameters()`` yields torch tensors that share memory with ORT's state, under the torch
    module's names. The hooks hand their work to collaborators the module holds: `live_session` (the
    running session), the step path, ``evaluation`` (the eval graph) and ``checkpointing``.

    Args:
        artifacts: `TrainingArtifacts` or the folder `export_artifacts` wrote.
        lr: peak learning rate; None means the `checkpoint`'s, else 1e-3.
        warmup_steps: optimizer steps of linear warmup, or a fraction of `total_steps` when a float
            in (0, 1); None means the `checkpoint`'s, else 0.
        total_steps: optimizer steps until the lr decays linearly to 0; None means the `checkpoint`'s,
            else ``trainer.estimated_stepping_batches``.
        lr_scheduler: ``"linear"`` (the default), ``"constant"``, a factory ``optimizer -> LRScheduler``
            stepped per optimizer step, or Lightning's scheduler dict around such a factory. A
            ``prepare_for_web`` folder computes its own rate and takes exactly its schedule's settings.
        metrics: a torchmetrics Metric, MetricCollection or dict of them, updated with the graph's first
            extra output and the first label, logged as ``train_<name>``, ``val_<name>``, ``test_<name>``.
        device: where to build the ORT components before a trainer says otherwise.
        checkpoint: an ORT checkpoint file to start from: its weights, optimizer state, step, epochs
            and seed. A nominal checkpoint needs `values`.
        values: name -> tensor for every parameter and buffer, in place of the checkpoint's weights.
        on_nonfinite: what a NaN/inf training loss does, decided by all ranks together: ``"raise"``
            (`NonFiniteLossError`, before the update) or ``"skip"`` (drop that optimizer step and warn).
        check_labels: refuse cross-entropy labels outside ``[0, classes)`` (ORT would train on them).
        custom_op_library: a shared library of custom operators; nothing is loaded unless named here.
        optimizer: None runs the artifacts' ORT optimizer graph; a factory ``params -> torch.optim.Optimizer``
            updates ORT's parameters in place instead (hybrid training; `lr` is then unused).
        labels: for a ``generate_artifacts`` folder with a custom loss block: the graph inputs that are labels.
        threads: ``"auto"`` shares the cores between ORT's and torch's thread pools during a fit
            (`ort_lightning.training.threads.policy`); ``"off"`` leaves both as they are.

    Raises:
        ConfigurationError: for a non-positive lr, an inconsistent schedule, an unknown `on_nonfinite`,
            a `custom_op_library` that cannot be loaded, or a schedule a web folder does not compute.
        ArtifactError: for an artifacts folder that does not validate, or a manifest of another model.
        CheckpointError: for a `checkpoint` that is damaged or does not match the artifacts.
    """

    def __init__(
        self,
        artifacts: TrainingArtifacts | str | os.PathLike[str],
        *,
        lr: float | None = None,
        warmup_steps: int | float | None = None,
        total_steps: int | None = None,
        lr_scheduler: str | SchedulerFactory | dict[str, Any] = "linear",
        metrics: Any = None,
        device: str = "cpu",
        checkpoint: str | os.PathLike[str] | None = None,
        on_nonfinite: str = "raise",
        check_labels: bool = True,
        custom_op_library: str | os.PathLike[str] | None = None,
        optimizer: _hybrid.OptimizerFactory | None = None,
        labels: Sequence[str] | None = None,
        threads: str = "auto",
        values: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self._threads = ThreadPolicy(threads)
        check_lr_scheduler(lr_scheduler)
        _hybrid.check_optimizer(optimizer)
        self._optimizer_factory = optimizer
        self._nonfinite = NonFiniteGuard(on_nonfinite)
        self.custom_op_library = None if custom_op_library is None else os.fspath(custom_op_library)
        self.artifacts = artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(
            artifacts, labels=labels)
        self.artifacts.check_labels(labels)
        # NOTE: a subclass's training_step may run ORT's graph and then return None; under
        # accumulation that micro-batch's gradients are then kept apart until it counts.
        overridden = type(self).training_step is not ORTLightningModule.training_step
        self._steps = StepPath(self._nonfinite, keep_apart=overridden, seed=torch.initial_seed())
        start: _ort.HeldState | None = None
        origin = RunOrigin()
        if checkpoint is not None:  # NOTE: the file is read once: its check and the session's build share the read
            properties, start = read_checkpoint_state(Path(checkpoint), self.artifacts,
                                                      weights_given=values is not None)
            origin = RunOrigin.of_file(properties)
        self._start_session(device, checkpoint=start, values=values)
        schedule = module_schedule(self.artifacts, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
                                   stored=origin.properties, lr_scheduler=lr_scheduler,
                                   on_nonfinite=on_nonfinite, hybrid=optimizer is not None)
        self.lr, self.warmup_steps, self.total_steps = schedule.lr, schedule.warmup_steps, schedule.total_steps
        self.lr_scheduler = lr_scheduler
        self.save_hyperparameters(
            {"artifacts": str(self.artifacts.directory), "lr": self.lr, "warmup_steps": self.warmup_steps,
             "total_steps": self.total_steps, "lr_scheduler": describe(lr_scheduler), "on_nonfinite": on_nonfinite,
             "check_labels": check_labels, "custom_op_library": self.custom_op_library,
             # NOTE: not named `optimizer`: load_from_checkpoint would pass the name back as the factory.
             "update": _hybrid.describe_optimizer(optimizer), "threads": threads,
             "labels": None if labels is None else list(labels)}
        )
        self._metrics = {} if metrics is None else stage_metrics_for(metrics, self.artifacts.manifest)
        for stage, collection in self._metrics.items():
            self.add_module(f"{stage}_metrics", collection)
        self._labels = label_range_of(self.artifacts) if check_labels else None
        self._connect(RunState(origin=origin))

    # ----------------------------------------------------------------------------- the ORT session
    @property
    def ort_session(self) -> _ort.TrainingSession:
        """The running ORT objects, read-only: another object after every rebuild, so read it again."""
        return self._live.session

    @property
    def live_session(self) -> LiveSession:
        """The running session and the one operation that changes it (`LiveSession.replace`)."""
        return self._live

    @property
    def seed(self) -> int:
        """The seed of ORT's random stream (dropout) in this run: the checkpoint's when it recorded one."""
        return self._steps.seed

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far for a NaN/inf loss (``on_nonfinite="skip"``)."""
        return self._nonfinite.skipped

    @property
    def thread_policy(self) -> ThreadPolicy:
        """The thread policy of this module's fits: its ``choice`` and the ``reason`` for it (see `ThreadPolicy`)."""
        return self._threads

    def _start_session(self, device: str, *, checkpoint: _ort.HeldState | None = None, values: Any = None) -> None:
        """Build the ORT session (`LiveSession`, the only place it is built and changed)."""
        threads = self._threads
        settings = SessionSettings(device=device, spinning=threads.spinning(None),
                                   intra_op_threads=threads.session_threads(None),
                                   custom_op_library=self.custom_op_library)
        self._live = LiveSession(
            self, self.artifacts, self._steps, settings=settings, checkpoint=checkpoint, values=values,
            optimizers=lambda: () if self._trainer is None else self.trainer.optimizers)

    def _connect(self, run: RunState) -> None:
        """Build the collaborators the hooks hand their work to; `run` is where the run stands."""
        self.evaluation = ModuleEvaluation(self._live, labels=self._labels, metrics=self._metrics,
                                           label_index=len(self.artifacts.manifest.inputs))
        hybrid = self._optimizer_factory is not None
        planned = planned_schedule_properties(lr=self.lr, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                                              lr_scheduler=self.lr_scheduler, hybrid=hybrid)
        self.checkpointing = CheckpointConnector(self._live, self._steps, self.artifacts, metrics=self._metrics,
                                                 hybrid=hybrid, run=run, planned=planned)

    # ----------------------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        """Refuse a precision other than ``"32-true"``, a strategy other than ``"ort_ddp"``, idle torch parameters."""
        check_strategy(self.trainer.strategy)
        install_atomic_io(self.trainer.strategy)
        self._threads.register(self.trainer, self._live.use_threads)
        check_precision(self.trainer.precision)
        if stage == "fit" and type(self).configure_optimizers is ORTLightningModule.configure_optimizers:
            # NOTE: before ModelSummary prints, so that it never counts an idle torch part as trainable.
            check_torch_parameters(self, self._live.views.trainable)

    @override
    def configure_model(self) -> None:
        """Rebuild the ORT components on the trainer's device (or without spinning under DDP), keeping the values.

        Views that Lightning's spawn launcher replaced by copies are attached to ORT's state again.
        """
        if self._trainer is None:  # load_from_checkpoint calls this hook without a trainer
            return
        strategy, threads, live = self.trainer.strategy, self._threads, self._live
        live.replace(settings=dataclasses.replace(
            live.settings, device=_device_string(strategy.root_device), spinning=threads.spinning(strategy),
            intra_op_threads=threads.session_threads(strategy)))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward and backward in ORT; gradients land in ORT's buffers. Logs ``train_loss``."""
        tensors, fetches, loss = self._steps.train(batch, self.trainer, batch_idx, self._labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=tensors[0].shape[0])
        if self._metrics:  # NOTE: checked here, so that a step without metrics goes nowhere else
            self._log_metrics("train", fetches, tensors)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        """Return the ORT optimizer (or the `optimizer` factory's torch one) and the schedule.

        Every ``fit`` starts a fresh optimizer state, except right after a restore (an exact resume).
        """
        checkpointing = self.checkpointing
        start = checkpointing.begin_fit()
        configured, checkpointing.schedule = configure(
            self._live.session, self._live.views.trainable, self.artifacts,
            factory=self._optimizer_factory, lr=self.lr, lr_scheduler=self.lr_scheduler, warmup_steps=self.warmup_steps,
            total_steps=lambda: total_steps_of(self.trainer, self.total_steps), start=start)
        return configured

    @override
    def on_train_start(self) -> None:
        """Refuse a fit whose linear schedule is already over, or torch parameters no optimizer updates."""
        # NOTE: a ckpt_path resume of a run that had reached its end (killed after its last save) has no
        # step left to take: Lightning ends it at once, as it does for torch modules.
        if self.trainer.global_step < self.trainer.estimated_stepping_batches:
            check_not_finished(self.checkpointing.schedule)
        check_torch_parameters(self, updated_parameters(self.trainer.optimizers))

    @override
    def lr_scheduler_step(self, scheduler: Any, metric: Any | None) -> None:
        """Step ORT's schedule (Lightning only steps torch schedulers by itself)."""
        if isinstance(scheduler, LinearLRSchedule):
            scheduler.step()
        else:
            super().lr_scheduler_step(scheduler, metric)

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Note that this micro-batch's gradients count: ORT computed them in ``training_step``."""
        self._steps.counted()

    @override
    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any | None = None
    ) -> None:
        """One optimizer step, in the order `ort_lightning.training.step.StepPath.step` spells out."""
        self._steps.step(optimizer, optimizer_closure, self.trainer)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Do nothing: the step path resets ORT's gradients right after each update.

        Lightning calls this after ``training_step``, where ORT's gradients already are: a reset there
        would drop the first micro-batch under accumulation.
        """

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ORT's gradient buffers and keep ``.grad`` the views of them (clipping needs them)."""
        self._steps.reset()

    @override
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ORTLightningModule:
        """Apply `fn` to the torch-side submodules (metrics) only; ORT's parameters stay in ORT's memory.

        Raises:
            ConfigurationError: for a conversion to a dtype other than float32.
        """
        live: LiveSession | None = self.__dict__.get("_live")
        if live is None:
            return super()._apply(fn, recurse)
        live.views.apply_beside(self, fn, recurse)
        return self

    # ----------------------------------------------------------------------------- checkpoints
    @override
    def on_train_epoch_end(self) -> None:
        """Stop the fit when the epoch's last update left NaN/inf in the parameters (no later loss shows it)."""
        self.checkpointing.check_parameters(self._trainer)

    @override
    def __getstate__(self) -> dict[str, Any]:
        """Leave out ORT's objects and what holds them (`_UNPICKLED`); keep the run and the device to rebuild on."""
        state = {name: value for name, value in super().__getstate__().items() if name not in _UNPICKLED}
        return {**state, DEVICE_KEY: self._live.session.device, _RUN_KEY: self.checkpointing.run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild ORT's objects from the artifacts on the pickled device, then copy the pickled values in by name."""
        device, run = state.pop(DEVICE_KEY), state.pop(_RUN_KEY)
        super().__setstate__(state)
        values = state_values(self, self.artifacts)
        # NOTE: a weightless folder has no weights to build from: its nominal checkpoint takes the pickled ones.
        self._start_session(device, values=values if self.artifacts.weightless else None)
        self._live.load(values)
        self._connect(run)
