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

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.bridge import BatchBinder, label_placeholder, parameter_views, to_torch, torch_device
from ort_lightning.errors import BatchError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.strategies import check_strategy, thread_spinning
from ort_lightning.training import hybrid as _hybrid
from ort_lightning.training.checkpoints import (
    ORT_STATE_KEY,
    PROGRESS_KEY,
    RunOrigin,
    export_inference,
    read_checkpoint,
    restored_state,
    snapshot,
    state_bytes,
    write_ort_checkpoint,
)
from ort_lightning.training.guards import NonFiniteGuard, check_graph_inputs, label_range_of
from ort_lightning.training.metrics import stage_metrics_for
from ort_lightning.training.optim import LinearLRSchedule, ORTOptimizer
from ort_lightning.training.portable import DEVICE_KEY, load_values, picklable, values_of, views_attached
from ort_lightning.training.schedules import (
    SchedulerFactory,
    check_lr_scheduler,
    check_not_finished,
    check_schedule,
    describe,
    lr_scheduler_config,
    resolve_schedule,
    schedule_properties,
    total_steps_of,
)
from ort_lightning.training.step import StepPath
from ort_lightning.training.views import GradientViews, bind_views, check_conversion

__all__ = ["ORTLightningModule"]

_SUPPORTED_PRECISION = "32-true"


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
            before every update.
        metrics: a torchmetrics Metric, MetricCollection or dict name -> Metric, updated with the
            graph's first extra output (the logits) and the first label, cloned per stage and logged
            as ``train_<name>``, ``val_<name>``, ``test_<name>`` (name: the dict key or the class name).
        device: where to build the ORT components before a trainer says otherwise
            (``"cpu"``, ``"cuda"``, ``"cuda:N"``).
        checkpoint: an ORT checkpoint file (from `ORTCheckpoint` or ``save_ort_checkpoint``) to
            start from instead of the artifacts' initial one: weights, and the optimizer state
            when the file has it. The run continues the file's: its schedule starts at the stored
            step, its epochs and steps count on, and ORT's random stream keeps the stored seed.
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

    Raises:
        ConfigurationError: for a non-positive lr, an inconsistent schedule, an unknown `on_nonfinite`,
            or a `custom_op_library` that is missing or cannot be loaded.
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
    ) -> None:
        super().__init__()
        check_lr_scheduler(lr_scheduler)
        _hybrid.check_optimizer(optimizer)
        self._optimizer_factory = optimizer
        self._nonfinite = NonFiniteGuard(on_nonfinite)
        self.custom_op_library = None if custom_op_library is None else os.fspath(custom_op_library)
        self.artifacts = artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts)
        # NOTE: a subclass's training_step may run ORT's graph and then return None; under
        # accumulation that micro-batch's gradients are then kept apart until it counts.
        overridden = type(self).training_step is not ORTLightningModule.training_step
        self._steps = StepPath(self._nonfinite, keep_apart=overridden, seed=torch.initial_seed())
        self._optimizers_configured = False  # a later fit starts a fresh optimizer (configure_optimizers)
        self._state_restored = False  # set by on_load_checkpoint: keep the restored optimizer state
        self._schedule: Any = None  # the scheduler of the current fit
        source = None if checkpoint is None else Path(checkpoint)
        self._set_origin(RunOrigin() if source is None else RunOrigin.of_file(read_checkpoint(source, self.artifacts)))
        self._session: _ort.TrainingSession = self._assemble(device, source)
        schedule = resolve_schedule(
            lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, stored=self._origin.properties
        )
        check_schedule(schedule.lr, schedule.warmup_steps, schedule.total_steps)
        self.lr, self.warmup_steps, self.total_steps = schedule.lr, schedule.warmup_steps, schedule.total_steps
        self.lr_scheduler = lr_scheduler
        self.save_hyperparameters(
            {"artifacts": str(self.artifacts.directory), "lr": self.lr, "warmup_steps": self.warmup_steps,
             "total_steps": self.total_steps, "lr_scheduler": describe(lr_scheduler), "on_nonfinite": on_nonfinite,
             "check_labels": check_labels, "custom_op_library": self.custom_op_library,
             # NOTE: not named `optimizer`: load_from_checkpoint would pass the name back as the factory.
             "update": _hybrid.describe_optimizer(optimizer)}
        )
        self._metrics = {} if metrics is None else stage_metrics_for(metrics, self.artifacts.manifest)
        for stage, collection in self._metrics.items():
            self.add_module(f"{stage}_metrics", collection)
        self._label_index = len(self.artifacts.manifest.inputs)
        check_graph_inputs(self.artifacts, self._session.input_names(training=True))
        self._labels = label_range_of(self.artifacts) if check_labels else None

    # ----------------------------------------------------------------------------- assembly
    def _assemble(self, device: str, checkpoint: Path | None = None, *, spinning: bool = True) -> _ort.TrainingSession:
        """Build the ORT components from `checkpoint`, else from a snapshot of the running ones, else anew."""
        artifacts = self.artifacts
        with contextlib.ExitStack() as stack:
            running: _ort.TrainingSession | None = self.__dict__.get("_session")
            source = checkpoint
            if source is None and running is not None:
                # NOTE: a rebuild on another device keeps the training progress of the running session.
                source = stack.enter_context(snapshot(running, include_optimizer_state=True))
            if source is None:
                source = artifacts.checkpoint
            session = _ort.assemble(
                training_model=artifacts.training_model,
                eval_model=artifacts.eval_model,
                optimizer_model=artifacts.optimizer_model,
                checkpoint=source,
                device=device,
                custom_op_library=self.custom_op_library,
                spinning=spinning,
            )
        target = torch_device(session.device)
        specs = artifacts.manifest.graph_inputs
        self._train_inputs = BatchBinder(specs, target, graph="training")
        self._eval_inputs = BatchBinder(specs, target, graph="eval")
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        views = parameter_views(session)
        self._gradients: GradientViews = bind_views(self, views, self.artifacts.manifest.buffers)
        self._ort_children = {view.name.split(".")[0] for view in views if "." in view.name}
        self._train_step = session.train_step
        self._steps.attach(session, self._gradients)
        self._eval_step = session.eval_step
        return session

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
        session = self._session
        with snapshot(session, include_optimizer_state=False) as path:
            self._session = self._assemble(session.device, path, spinning=session.spinning)
        self._set_origin(RunOrigin(seed=self._steps.seed))

    # ----------------------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        """Refuse a Trainer precision other than ``"32-true"``, or a parallel strategy other than ``"ort_ddp"``."""
        check_strategy(self.trainer.strategy)
        precision = str(self.trainer.precision)
        if precision != _SUPPORTED_PRECISION:
            raise ConfigurationError(
                f"ORT training graphs run in float32, but the Trainer has precision={precision!r}; "
                f"use Trainer(precision={_SUPPORTED_PRECISION!r})."
            )

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
        spinning = thread_spinning(self.trainer.strategy)
        rebuild = device != self._session.device or spinning != self._session.spinning
        if not rebuild and views_attached(self, self._session):
            return
        values = values_of(self)
        if rebuild:
            self._session = self._assemble(device, spinning=spinning)
        else:
            self._gradients = bind_views(self, parameter_views(self._session), self.artifacts.manifest.buffers)
        load_values(self, values)

    @override
    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the eval graph on model inputs; return its model outputs as torch tensors.

        Labels are not needed: placeholders fill the label inputs (the loss is discarded).
        """
        fetches = self._session.eval_step(self._eval_inputs([*inputs, *self._label_placeholders(inputs)]))
        outputs = tuple(to_torch(fetches[i]) for i in range(1, len(fetches)))
        return outputs[0] if len(outputs) == 1 else outputs

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward and backward in ORT; gradients land in ORT's buffers. Logs ``train_loss``."""
        self._steps.before_graph(self.trainer, batch_idx)
        tensors, fetches, loss = self._run_graph(self._train_inputs, self._train_step, batch, graph="training")
        self._nonfinite.observe(loss, self.trainer, batch_idx)
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
        count = len(self.artifacts.manifest.inputs)
        if isinstance(batch, dict):
            return self(*(batch[spec.name] for spec in self.artifacts.manifest.inputs))
        if isinstance(batch, torch.Tensor):
            return self(batch)
        return self(*batch[:count])

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
        """Refuse a fit whose linear schedule is already over (every step would run at lr 0)."""
        check_not_finished(self._schedule)

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
        session = self.__dict__.get("_session")
        if session is None:
            return super()._apply(fn, recurse)
        device = torch_device(session.device)
        try:
            check_conversion(fn, device)
            for name, child in self._modules.items():
                if name not in self._ort_children and child is not None:
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
        """
        # NOTE: under a torch optimizer (hybrid training) ORT's optimizer state is never used;
        # the file holds the weights, and the torch optimizer's state lives in Lightning's .ckpt.
        include_optimizer_state = include_optimizer_state and self._optimizer_factory is None
        values: dict[str, int | float | str] = {
            "lr": float(self._session.get_lr()), "optimizer_state": int(include_optimizer_state),
            "seed": self._steps.seed_in_use(), **schedule_properties(self._schedule),
            **self._origin.progress_properties(self._trainer), **(properties or {}),
        }
        return write_ort_checkpoint(
            self._session, path, include_optimizer_state=include_optimizer_state, properties=values
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
        names = list(outputs) if outputs is not None else list(self.artifacts.manifest.outputs)
        return export_inference(self._session, path, names)

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run.

        Nonzero when the run started from an ORT checkpoint: the first epoch of this run is epoch
        ``start_progress["epoch"]`` of the whole training, so that numbers never repeat.
        """
        return {"global_step": self._origin.step, "epoch": self._origin.epoch}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the full ORT state (weights, optimizer step and moments) as uint8 bytes.

        Under hybrid training the weights only: the torch optimizer's state is Lightning's own entry.
        """
        checkpoint[ORT_STATE_KEY] = state_bytes(self._session, include_optimizer_state=self._optimizer_factory is None)
        checkpoint[PROGRESS_KEY] = self._origin.lightning_record(self._steps.seed_in_use())

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs)."""
        state = checkpoint.get(ORT_STATE_KEY)
        if state is None:
            return
        session = self._session
        with restored_state(state) as path:
            self._session = self._assemble(session.device, path, spinning=session.spinning)
        self._state_restored = True
        self._set_origin(RunOrigin.of_lightning(checkpoint.get(PROGRESS_KEY, {})))

    @override
    def __getstate__(self) -> dict[str, Any]:
        """Leave the ORT objects out (they do not pickle); `__setstate__` rebuilds them."""
        return picklable(super().__getstate__(), self._session)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the ORT objects from the artifacts, then restore the pickled parameter values."""
        device = state.pop(DEVICE_KEY)
        super().__setstate__(state)
        values = values_of(self)
        self._session = self._assemble(device)
        load_values(self, values)

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
        _, fetches, loss = self._run_graph(self._eval_inputs, self._eval_step, batch, graph="eval")
        return (loss, *(to_torch(fetches[i]) for i in range(1, len(fetches))))

    # ----------------------------------------------------------------------------- helpers
    def _run_graph(
        self, binder: BatchBinder, step: Callable[[Any], Any], batch: Any, *, graph: str
    ) -> tuple[Any, Any, torch.Tensor]:
        """Bind `batch`, check its labels, run one graph step; return the tensors, fetches and loss."""
        tensors = binder.ordered(batch)
        if self._labels is not None:
            self._labels(tensors, graph=graph)
        fetches = binder.run(step, tensors)
        return tensors, fetches, to_torch(fetches[0])

    def _evaluate(self, stage: str, batch: Any) -> torch.Tensor:
        tensors, fetches, loss = self._run_graph(self._eval_inputs, self._eval_step, batch, graph="eval")
        size = tensors[0].shape[0]
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=size, sync_dist=self.trainer.world_size > 1)
        if self._metrics:
            self._update_metrics(stage, fetches, tensors)
        return loss

    def _update_metrics(self, stage: str, fetches: Any, tensors: Any) -> None:
        collection = self._metrics[stage]
        collection.update(to_torch(fetches[1]), tensors[self._label_index])
        self.log_dict(collection, on_step=False, on_epoch=True, batch_size=tensors[0].shape[0])

    def _label_placeholders(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if not inputs:
            raise BatchError(
                f"forward() expects the model inputs {[s.name for s in self.artifacts.manifest.inputs]}, got none."
            )
        batch = inputs[0].shape[0]
        cached = self._placeholders.get(batch)
        if cached is None:
            device = torch_device(self._session.device)
            cached = [label_placeholder(spec, batch, device) for spec in self.artifacts.manifest.labels]
            self._placeholders[batch] = cached
        return cached
