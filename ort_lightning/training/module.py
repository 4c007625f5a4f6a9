"""`ORTLightningModule`: a LightningModule whose forward, backward and update run in ONNX Runtime.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp())
    >>> module = ORTLightningModule(artifacts, lr=0.01)
    >>> sorted(name for name, _ in module.named_parameters())
    ['bias', 'weight']
    >>> module(torch.zeros(5, 4)).shape
    torch.Size([5, 3])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import check_values, state_specs
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.strategies import check_strategy
from ort_lightning.training.checkpointing.connector import CheckpointConnector, find_artifacts
from ort_lightning.training.checkpointing.files import RunOrigin, read_checkpoint
from ort_lightning.training.checkpointing.io import install_atomic_io
from ort_lightning.training.guards import (
    SUPPORTED_PRECISION,
    check_can_train,
    check_model_outputs,
    check_torch_parameters,
    label_range_of,
    precision_supported,
    updated_parameters,
)
from ort_lightning.training.metrics import stage_metrics_for
from ort_lightning.training.optim import hybrid as _hybrid
from ort_lightning.training.optim.graph_schedule import check_graph_schedule
from ort_lightning.training.optim.ort_optimizer import LinearLRSchedule, ORTOptimizer
from ort_lightning.training.optim.schedules import (
    SchedulerFactory,
    check_lr_scheduler,
    check_not_finished,
    check_schedule,
    describe,
    lr_scheduler_config,
    resolve_schedule,
    total_steps_of,
)
from ort_lightning.training.session.parameters import GradientViews, check_conversion
from ort_lightning.training.session.session_views import DEVICE_KEY, SessionViews, load_values, values_of
from ort_lightning.training.session.step import NonFiniteGuard, StepPath
from ort_lightning.training.threads.policy import ThreadPolicy

__all__ = ["ORTLightningModule"]

def _device_string(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


class ORTLightningModule(pl.LightningModule):
    """Train ONNX Runtime training artifacts with an ordinary ``lightning.Trainer``.

    The ORT components (CheckpointState, Module, Optimizer) are built at once on the CPU, and
    again in ``configure_model`` if the trainer runs on another device. ``named_parameters()``
    yields torch tensors that share memory with ORT's state, under the torch module's names.

    Args:
        artifacts: `TrainingArtifacts` or the folder `export_artifacts` wrote.
        lr: peak learning rate; None means the `checkpoint`'s, else 1e-3.
        warmup_steps: optimizer steps of linear warmup from 0 to `lr`, as a count, or as a
            fraction of `total_steps` when a float in (0, 1); a warmup longer than the run stays in
            the warmup. None means the `checkpoint`'s, else 0.
        total_steps: optimizer steps until the lr decays linearly to 0; None means the
            `checkpoint`'s, else ``trainer.estimated_stepping_batches``.
        lr_scheduler: ``"linear"`` (linear warmup/decay, the default), ``"constant"``, a factory
            ``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (cosine, step, one-cycle) stepped
            per optimizer step, or Lightning's scheduler dict with such a factory under
            ``"scheduler"`` (``interval``, ``frequency``, ``monitor``, e.g. for ``ReduceLROnPlateau``).
            Schedules count Lightning's optimizer steps, skipped ones included; the lr reaches ORT
            before every update. A folder from ``prepare_for_web`` computes its own rate: it takes
            exactly its schedule's settings (``ort-lightning inspect`` prints them).
        metrics: a torchmetrics Metric, MetricCollection or dict name -> Metric, updated with the
            graph's first extra output (the logits) and the first label, cloned per stage and logged
            as ``train_<name>``, ``val_<name>``, ``test_<name>`` (name: the dict key or the class name).
        device: where to build the ORT components before a trainer says otherwise
            (``"cpu"``, ``"cuda"``, ``"cuda:N"``).
        checkpoint: an ORT checkpoint file (from `ORTCheckpoint` or ``save_ort_checkpoint``) to
            start from instead of the artifacts' initial one: weights, and the optimizer state
            when the file has it. The run continues the file's: its schedule starts at the stored
            step, its epochs and steps count on, and ORT's random stream keeps the stored seed. A
            nominal checkpoint (no weights, ``export_artifacts(..., nominal_checkpoint=True)``) needs `values`.
        values: name -> tensor for every parameter and buffer (``ort_lightning.fleet.get_values`` of a
            module of the same artifacts), copied into ORT's state in place of the `checkpoint`'s weights
            before anything else runs, as a device starts from a nominal checkpoint and weights it received.
        on_nonfinite: what a NaN/inf training loss does, decided once per optimizer step by all ranks
            together: ``"raise"`` (`NonFiniteLossError`, before the update touches the parameters) or
            ``"skip"`` (drop that optimizer step, every micro-batch of it, reset the gradients and warn).
        check_labels: refuse cross-entropy labels outside ``[0, classes)`` (one ``aminmax`` per batch;
            ORT would train on them with a wrong loss).
        custom_op_library: a shared library of custom operators to register with ONNX Runtime; nothing
            is ever loaded from the artifacts folder unless named here.
        optimizer: None (the default) runs the artifacts' ORT optimizer graph; a factory
            ``params -> torch.optim.Optimizer`` (``lambda p: torch.optim.AdamW(p, lr=3e-4, fused=True)``)
            makes ORT compute forward and backward and that torch optimizer update ORT's parameters
            in place (hybrid training). Its lr is the factory's; `lr` is then unused.
        labels: for a ``generate_artifacts`` folder whose loss is a custom block: the graph inputs
            that are labels (``[]``: none); ORT's own ``labels``/``target`` are found without it. An
            exported folder's manifest names its labels: the same list is accepted, another refused.
        threads: ``"auto"`` (the default) makes ORT's and torch's thread pools share the cores during
            a fit: ORT's pool sized to the cores the process may use (per rank under ``"ort_ddp"``),
            torch's threads lowered while ORT computes (a torch optimizer's update included) and
            restored when the fit ends, the fastest setting measured on the first steps (see
            `ort_lightning.training.threads.policy`); a thread count the user set is never overridden.
            ``"off"`` leaves both pools as they are.

    Raises:
        ConfigurationError: for a non-positive lr, an inconsistent schedule, an unknown `on_nonfinite`,
            a `custom_op_library` that is missing or cannot be loaded, or a schedule other than the one
            a ``prepare_for_web`` folder computes in its optimizer graph.
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
        self.artifacts = (
            artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts, labels=labels)
        )
        self.artifacts.check_labels(labels)
        # NOTE: a subclass's training_step may run ORT's graph and then return None; under
        # accumulation that micro-batch's gradients are then kept apart until it counts.
        overridden = type(self).training_step is not ORTLightningModule.training_step
        self._steps = StepPath(self._nonfinite, keep_apart=overridden, seed=torch.initial_seed())
        self._optimizers_configured = False  # a later fit starts a fresh optimizer (configure_optimizers)
        self._state_restored = False  # set by on_load_checkpoint: keep the restored optimizer state
        self._schedule: Any = None  # the scheduler of the current fit
        self._checkpoints = CheckpointConnector(self)
        source = None if checkpoint is None else Path(checkpoint)
        self._set_origin(RunOrigin() if source is None else RunOrigin.of_file(
            read_checkpoint(source, self.artifacts, weights_given=values is not None)))
        self._attach(SessionViews(self, self.artifacts, device=device, checkpoint=source, values=values,
                                  custom_op_library=self.custom_op_library, **self._thread_options(None)))
        schedule = resolve_schedule(
            lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, stored=self._origin.properties
        )
        check_schedule(schedule.lr, schedule.warmup_steps, schedule.total_steps)
        check_graph_schedule(self.artifacts.manifest.lr_schedule, schedule, lr_scheduler,
                             folder=self.artifacts.directory, on_nonfinite=on_nonfinite, hybrid=optimizer is not None)
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
        self._label_index = len(self.artifacts.manifest.inputs)
        self._labels = label_range_of(self.artifacts) if check_labels else None

    # ----------------------------------------------------------------------------- the ORT session
    def _attach(self, views: SessionViews) -> None:
        """Make `views` this module's ORT session; the step path follows it."""
        self._ort = views
        self._steps.attach(views.session, views.gradients)

    @property
    def _session(self) -> _ort.TrainingSession:
        return self._ort.session

    @property
    def _gradients(self) -> GradientViews:
        return self._ort.gradients

    @property
    def _train_inputs(self) -> BatchBinder:
        return self._ort.train_inputs

    @property
    def _train_step(self) -> Callable[[Any], Any]:
        return self._ort.train_step

    def _thread_options(self, strategy: Any) -> dict[str, Any]:
        """ORT's spinning and intra-op pool size under `strategy`, as the thread policy wants them."""
        policy = self._threads
        return {"spinning": policy.spinning(strategy), "intra_op_threads": policy.session_threads(strategy)}

    def _use_session_threads(self, spinning: bool, intra_op_threads: int) -> None:
        """Run ORT with these thread settings from the next step on (the thread policy's candidates).

        Between two optimizer steps only: the session is rebuilt from a snapshot of its exact state
        (weights, the optimizer's step and moments), and the fit's optimizers follow it.
        """
        session = self._session
        if (session.spinning, session.intra_op_threads) == (spinning, intra_op_threads):
            return
        self._attach(self._ort.rebuilt(self, spinning=spinning, intra_op_threads=intra_op_threads))
        for optimizer in self.trainer.optimizers:
            if hasattr(optimizer, "session"):
                optimizer.session = self._session

    def _set_origin(self, origin: RunOrigin) -> None:
        """Continue the steps, epochs and seed of the run that wrote the checkpoint this run starts from."""
        self._origin = origin
        self._steps.step_offset = origin.step
        if origin.seed is not None:
            self._steps.seed = origin.seed

    def _restart_optimizer(self) -> None:
        """Rebuild the ORT components from the current weights with a fresh optimizer state.

        What torch Lightning gets on every ``fit``: ``configure_optimizers`` makes a new optimizer
        (step 0, no moments), so a second ``fit`` warms up and decays again instead of staying at
        the end of the first one's schedule; its steps and epochs count from 0.
        """
        self._attach(self._ort.rebuilt(self, include_optimizer_state=False))
        self._set_origin(RunOrigin(seed=self._steps.seed))

    # ----------------------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        """Refuse a precision other than ``"32-true"``, a strategy other than ``"ort_ddp"``, idle torch parameters.

        Also makes Lightning's ``.ckpt`` writes atomic (`ort_lightning.training.checkpointing.io`).
        """
        check_strategy(self.trainer.strategy)
        install_atomic_io(self.trainer.strategy)
        self._threads.register(self.trainer)
        precision = str(self.trainer.precision)
        if not precision_supported(precision):
            raise ConfigurationError(
                f"ORT training graphs run in float32, but the Trainer has precision={precision!r}; "
                f"use Trainer(precision={SUPPORTED_PRECISION!r})."
            )
        if stage == "fit" and type(self).configure_optimizers is ORTLightningModule.configure_optimizers:
            # NOTE: before ModelSummary prints, so that it never counts an idle torch part as trainable.
            check_torch_parameters(self, _hybrid.trainable(self._gradients.pairs))

    @override
    def configure_model(self) -> None:
        """Rebuild the ORT components on the trainer's root device when it is not theirs.

        Also rebuilt when the strategy wants ORT's threads not to spin (DDP ranks sharing a
        CPU). The module's current values are kept. Views that were replaced by copies
        (Lightning's spawn launcher clones every parameter's ``.data`` on CPU) are attached to
        ORT's state again.
        """
        if self._trainer is None:  # load_from_checkpoint calls this hook without a trainer
            return
        device = _device_string(self.trainer.strategy.root_device)
        threads = self._thread_options(self.trainer.strategy)
        session = self._session
        rebuild = device != session.device or (threads["spinning"], threads["intra_op_threads"]) != (
            session.spinning, session.intra_op_threads)
        if not rebuild and self._ort.attached(self):
            return
        values = values_of(self)
        if rebuild:
            self._attach(self._ort.rebuilt(self, device=device, **threads))
        else:
            self._ort.reattach(self)
            self._steps.attach(self._session, self._gradients)
        load_values(self, values)

    @override
    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the eval graph on model inputs; return its model outputs as torch tensors.

        Labels are not needed: placeholders fill the label inputs (the loss is discarded).
        """
        return self._outputs(self._ort.infer(inputs, entry="forward()", labels_allowed=False))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward and backward in ORT; gradients land in ORT's buffers. Logs ``train_loss``."""
        tensors, fetches, loss = self._steps.train(self._ort.train_inputs, batch, self.trainer, batch_idx, self._labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=tensors[0].shape[0])
        if self._metrics:
            self._update_metrics("train", fetches, tensors)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Run the eval graph and log ``val_loss`` (and the ``val_`` metrics)."""
        return self._evaluate("val", batch)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Run the eval graph and log ``test_loss`` (and the ``test_`` metrics)."""
        return self._evaluate("test", batch)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return the model outputs for a batch of model inputs (labels, if present, are ignored)."""
        return self._outputs(self._ort.infer(batch, entry="predict_step()", labels_allowed=True))

    @override
    def configure_optimizers(self) -> Any:
        """Return the ORT optimizer (or the `optimizer` factory's torch one) and the `lr_scheduler` schedule.

        As in torch Lightning, every ``fit`` starts a fresh optimizer (step 0, no moments), except
        when the state was just restored (``checkpoint=`` before the first fit, or ``ckpt_path=``),
        so that a resume continues exactly.
        """
        if self._optimizers_configured and not self._state_restored:
            self._restart_optimizer()
        self._optimizers_configured, self._state_restored = True, False
        params = _hybrid.trainable(self._gradients.pairs)
        optimizer: torch.optim.Optimizer
        if self._optimizer_factory is None:
            check_can_train(self.artifacts)
            optimizer = ORTOptimizer(self._session, params, lr=self.lr)
        else:
            optimizer = _hybrid.build(self._optimizer_factory, self._session, params)

        def total_steps() -> int:
            return total_steps_of(self.trainer, self.total_steps)

        scheduler = lr_scheduler_config(
            optimizer, self.lr_scheduler, warmup_steps=self.warmup_steps, total_steps=total_steps,
            start=self._origin.schedule,
        )
        self._schedule = None if scheduler is None else scheduler["scheduler"]
        return optimizer if scheduler is None else {"optimizer": optimizer, "lr_scheduler": scheduler}

    @override
    def on_train_start(self) -> None:
        """Refuse a fit whose linear schedule is already over, or torch parameters no optimizer updates."""
        # NOTE: a ckpt_path resume of a run that had reached its end (killed after its last save) has no
        # step left to take: Lightning ends it at once, as it does for torch modules.
        if self.trainer.global_step < self.trainer.estimated_stepping_batches:
            check_not_finished(self._schedule)
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
        """Note that this micro-batch's gradients count: ORT computed them in ``training_step``.

        Lightning calls it only for a ``training_step`` that returned a loss.
        """
        self._steps.counted()

    @override
    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any | None = None
    ) -> None:
        """One optimizer step, in the order `ort_lightning.training.step.StepPath.step` spells out.

        Run the closure (the last micro-batch), mark the window, scale by ``1/accumulate_grad_batches``
        (ORT sums, Lightning averages), re-bind the gradient views, decide a NaN/inf skip on all
        ranks, let Lightning all-reduce and clip, update, reset ORT's gradient buffers.
        """
        self._steps.step(optimizer, optimizer_closure, self.trainer)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        """Do nothing: the step path resets ORT's gradients right after each update.

        Lightning calls this inside the closure after ``training_step``: right for torch, whose
        gradients appear in ``backward``, wrong for ORT, whose gradients appear in ``training_step``
        (a reset there would throw away the first micro-batch under accumulation).
        """

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ORT's gradient buffers and keep ``.grad`` the views of them.

        ``torch.nn.Module.zero_grad`` would set ``.grad`` to None, cutting the views: gradient
        clipping would then see no gradients and silently do nothing.
        """
        self._steps.reset()

    @override
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ORTLightningModule:
        """Apply `fn` to the torch-side submodules (metrics) only; ORT's parameters stay in ORT's memory.

        The ORT components follow the trainer's device in `configure_model`; a dtype conversion
        is refused, since it would copy the parameters away from what ORT trains.

        Raises:
            ConfigurationError: for a conversion to a dtype other than float32.
        """
        ort: SessionViews | None = self.__dict__.get("_ort")
        if ort is None:
            return super()._apply(fn, recurse)
        device = ort.device
        try:
            check_conversion(fn, device)
            for name, child in self._modules.items():
                if name not in ort.ort_children and child is not None:
                    child._apply(fn, recurse)
        finally:
            # NOTE: Lightning's .to()/.half() record the new device and dtype before calling
            # _apply; the module still lives where ORT runs it, in float32.
            self._device = device
            self._dtype = torch.float32
        return self

    # ----------------------------------------------------------------------------- checkpoints
    def save_ort_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_optimizer_state: bool = True,
        properties: dict[str, int | float | str] | None = None,
    ) -> Path:
        """Write the ORT CheckpointState to `path` atomically, with a ``.sha256`` sidecar digest.

        The file is what ``onnxruntime.training.api.CheckpointState.load_checkpoint`` reads and
        what ``ORTLightningModule(artifacts, checkpoint=path)`` resumes from.

        Args:
            path: the checkpoint file to create or replace.
            include_optimizer_state: also store the optimizer's step count and moments, which an
                exact resume needs. Under hybrid training (``optimizer=`` a torch optimizer) the file
                holds the weights only: the torch optimizer's state is in Lightning's ``.ckpt``.
            properties: int, float or str values stored in the file. Always added: ``lr``,
                ``ort_lightning_version``, ``optimizer_state`` (1 or 0) and ``seed`` (ORT's random
                stream); the linear schedule's ``schedule_lr``, ``schedule_warmup_steps`` and
                ``schedule_total_steps``; inside a fit, ``global_step``, ``epoch`` and ``next_epoch``
                (the epoch a resume starts in), counted across resumes.

        Returns:
            The path written.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self._check_parameters()
        return self._checkpoints.save_ort_checkpoint(
            path, include_optimizer_state=include_optimizer_state, properties=properties
        )

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None = None) -> Path:
        """Write the eval graph with the current weights as a plain ONNX inference model.

        The model takes the model inputs only (no labels) and runs in
        ``onnxruntime.InferenceSession``.

        Args:
            path: the ``.onnx`` file to create or replace (atomically).
            outputs: eval graph outputs to keep; None keeps the model's own outputs.

        Returns:
            The path written.

        Raises:
            ConfigurationError: for an output name the eval graph does not have.
        """
        return self._checkpoints.export_inference_model(path, outputs)

    @override
    def to_onnx(self, file_path: Any = None, input_sample: Any = None, **kwargs: Any) -> None:
        """Write the inference model, as `export_inference_model` does (`input_sample` is not needed).

        Lightning's ``to_onnx`` traces ``forward`` with ``torch.onnx``; here the graph already exists.

        Raises:
            ConfigurationError: for no file path (or a buffer), or ``torch.onnx.export`` options.
        """
        self._checkpoints.to_onnx(file_path, kwargs)

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run.

        Nonzero when the run started from an ORT checkpoint: the first epoch of this run is epoch
        ``start_progress["epoch"]`` of the whole training, so that numbers never repeat.
        """
        return {"global_step": self._origin.step, "epoch": self._origin.epoch}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the full ORT state (weights, optimizer step and moments) as uint8 bytes, the progress and identity.

        Under hybrid training the weights only: the torch optimizer's state is Lightning's own entry.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self._check_parameters()
        self._checkpoints.dump(checkpoint)

    @override
    def on_train_epoch_end(self) -> None:
        """Stop the fit when the epoch's last update left NaN/inf in the parameters (no later loss shows it)."""
        self._check_parameters()

    def _check_parameters(self) -> None:
        # NOTE: between two saves the next step's NaN loss shows an overflowed update; the steps pay nothing.
        if self._trainer is not None and self._trainer.training:
            self._steps.check_parameters(self._trainer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs).

        Raises:
            CheckpointError: for a ``.ckpt`` of other artifacts, or metrics it was trained with and that
                are not passed again.
        """
        if self._checkpoints.restore(checkpoint):
            self._state_restored = True

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, finding a moved artifacts folder relative to the ``.ckpt``.

        The stored artifacts path is used when it exists; else the folder is looked for beside the
        ``.ckpt`` and in its parent folders; ``artifacts=`` overrides both. The ``.ckpt``'s artifacts
        (graph digests, parameters, optimizer kind) must be the ones it is loaded onto.

        Nothing the ``.ckpt`` names is loaded or run as code: a stored ``custom_op_library`` (or a
        factory, or a path to a shared library) is refused unless passed again,
        ``load_from_checkpoint(path, custom_op_library=...)``.

        Raises:
            CheckpointError: for artifacts found nowhere (pass ``artifacts=``), artifacts of another model
                or optimizer, metrics the ``.ckpt`` was trained with and that are not passed again, or a stored
                hyper-parameter naming code to load that is not passed again.
        """
        return super().load_from_checkpoint(checkpoint_path, *args, **find_artifacts(checkpoint_path, kwargs))

    @override
    def __getstate__(self) -> dict[str, Any]:
        """Leave the ORT objects out (they do not pickle); `__setstate__` rebuilds them."""
        return self._checkpoints.getstate(super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the ORT objects from the artifacts, then restore the pickled parameter values."""
        device = state.pop(DEVICE_KEY)
        super().__setstate__(state)
        self._checkpoints.rebuild(device)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """Run the eval graph on one labelled batch, outside any Trainer; return ``(loss, *model_outputs)``.

        Args:
            batch: a tuple/list in the order of the graph's inputs (model inputs, then labels), or a
                dict keyed by input name, as for ``validation_step``.

        Example::

            >>> import tempfile
            >>> from ort_lightning import export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp())
            >>> module = ORTLightningModule(artifacts)
            >>> loss, logits = module.evaluate_batch((torch.zeros(2, 4), torch.tensor([0, 2])))
            >>> tuple(loss.shape), tuple(logits.shape)
            ((), (2, 3))
        """
        _, fetches, loss = self._ort.eval_inputs.step(self._ort.eval_step, batch, self._labels)
        return (loss, *(to_torch(fetches[i]) for i in range(1, len(fetches))))

    # ----------------------------------------------------------------------------- helpers
    def _evaluate(self, stage: str, batch: Any) -> torch.Tensor:
        tensors, fetches, loss = self._ort.eval_inputs.step(self._ort.eval_step, batch, self._labels)
        size = tensors[0].shape[0]
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=size, sync_dist=self.trainer.world_size > 1)
        if self._metrics:
            self._update_metrics(stage, fetches, tensors)
        return loss

    def _update_metrics(self, stage: str, fetches: Any, tensors: Any) -> None:
        collection = self._metrics[stage]
        collection.update(to_torch(fetches[1]), tensors[self._label_index])
        self.log_dict(collection, on_step=False, on_epoch=True, batch_size=tensors[0].shape[0])

    def _outputs(self, fetches: Any) -> Any:
        """The model outputs of an eval step (its first output is the loss), as torch tensors."""
        check_model_outputs(self.artifacts, len(fetches))
        outputs = tuple(to_torch(fetches[i]) for i in range(1, len(fetches)))
        return outputs[0] if len(outputs) == 1 else outputs

    # ----------------------------------------------------------------------------- another start, same module
    def load_values(self, values: Mapping[str, Any], *, optimizer_state: str | os.PathLike[str] | None = None) -> None:
        """Start again from `values`: with a fresh optimizer state, or with the one `optimizer_state` kept.

        What a new module of the same artifacts built with ``values=values`` (and
        ``checkpoint=optimizer_state``) starts from, in this module: ONNX Runtime sets an optimizer
        state (step and moments) only when it builds its objects, so they are built again, in the
        sequence that module would build them (state, Module, the values copied in, Optimizer),
        with this session's device and threads. Where ORT holds no optimizer state (an SGD graph, a
        torch optimizer's update) a fresh start only copies the values into ORT's memory through
        the views. Gradients start at zero either way; the next fit keeps the optimizer state.

        Args:
            values: name -> tensor for every state tensor (``ort_lightning.fleet.get_values`` of a module of
                these artifacts).
            optimizer_state: an ORT checkpoint file of these artifacts whose optimizer state to continue
                (``save_ort_checkpoint(..., include_optimizer_state=True)``): its steps and epochs count on,
                as with ``checkpoint=``; None starts a fresh optimizer state, its steps counted from 0.

        Raises:
            ConfigurationError: for `values` with missing, unexpected or misshapen tensors.
            CheckpointError: for an `optimizer_state` file that is damaged or of other artifacts.

        Example::

            >>> import tempfile
            >>> from ort_lightning import export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp())
            >>> module = ORTLightningModule(artifacts)
            >>> module.load_values({"weight": torch.ones(3, 4), "bias": torch.zeros(3)})
            >>> float(module.weight.detach().sum()), module.start_progress["global_step"]
            (12.0, 0)
        """
        kept = None if optimizer_state is None else Path(optimizer_state)
        origin = RunOrigin(seed=self._steps.seed) if kept is None else RunOrigin.of_file(
            read_checkpoint(kept, self.artifacts, weights_given=True))
        session = self._session
        if kept is None and (self._optimizer_factory is not None or session.optimizer_kind != "adamw"):
            # NOTE: no optimizer state in ORT (SGD, a torch optimizer's update): the values are all there is to load.
            checked = check_values(values, state_specs(self.artifacts))
            load_values(self, [checked.get(name, tensor) for name, tensor in (*self.named_parameters(),
                                                                              *self.named_buffers())])
            self._steps.reset()
        else:
            # NOTE: a fresh state starts from the nominal checkpoint where there is one: no weights to read.
            self._attach(SessionViews(
                self, self.artifacts, device=session.device, checkpoint=kept or self.artifacts.nominal_checkpoint,
                values=values, spinning=session.spinning, intra_op_threads=session.intra_op_threads,
                custom_op_library=self.custom_op_library))
        self._set_origin(origin)
        self._optimizers_configured, self._state_restored = False, kept is not None
