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
from typing import Any

import lightning.pytorch as pl
import torch

from ort_lightning import _ort
from ort_lightning.artifacts import TensorSpec, TrainingArtifacts
from ort_lightning.bridge import BatchBinder, ParameterView, parameter_views, to_torch, torch_device
from ort_lightning.errors import BatchError, ConfigurationError
from ort_lightning.optim import LinearLRSchedule, ORTOptimizer
from ort_lightning.strategies import check_strategy

__all__ = ["ORTLightningModule"]

_SUPPORTED_PRECISION = "32-true"

#: Attributes holding ORT objects or views of them, rebuilt after unpickling (spawn, deepcopy).
_UNPICKLED = ("_session", "_train_inputs", "_eval_inputs", "_placeholders", "_grads")


def _device_string(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


class ORTLightningModule(pl.LightningModule):
    """Train ONNX Runtime training artifacts with an ordinary ``lightning.Trainer``.

    The ORT components (CheckpointState, Module, Optimizer) are built at once on the CPU, and
    again in ``configure_model`` if the trainer runs on another device. ``named_parameters()``
    yields torch tensors that share memory with ORT's state, under the torch module's names.

    Args:
        artifacts: `TrainingArtifacts` or the folder `export_artifacts` wrote.
        lr: peak learning rate.
        warmup_steps: optimizer steps of linear warmup from 0 to `lr`, as a count, or as a
            fraction of `total_steps` when a float in (0, 1).
        total_steps: optimizer steps until the lr decays linearly to 0; None means
            ``trainer.estimated_stepping_batches``.
        device: where to build the ORT components before a trainer says otherwise
            (``"cpu"``, ``"cuda"``, ``"cuda:N"``).

    Raises:
        ConfigurationError: for a non-positive lr or an inconsistent schedule.
        ArtifactError: for an artifacts folder that does not validate.
    """

    def __init__(
        self,
        artifacts: TrainingArtifacts | str | os.PathLike[str],
        *,
        lr: float = 1e-3,
        warmup_steps: int | float = 0,
        total_steps: int | None = None,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        _check_schedule(lr, warmup_steps, total_steps)
        self.artifacts = artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts)
        self.lr = float(lr)
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.save_hyperparameters(
            {"artifacts": str(self.artifacts.directory), "lr": self.lr, "warmup_steps": warmup_steps,
             "total_steps": total_steps}
        )
        self._session: _ort.TrainingSession = self._assemble(device)

    # ----------------------------------------------------------------------------- assembly
    def _assemble(self, device: str) -> _ort.TrainingSession:
        artifacts = self.artifacts
        session = _ort.assemble(
            training_model=artifacts.training_model,
            eval_model=artifacts.eval_model,
            optimizer_model=artifacts.optimizer_model,
            checkpoint=artifacts.checkpoint,
            device=device,
        )
        target = torch_device(session.device)
        specs = artifacts.manifest.graph_inputs
        self._train_inputs = BatchBinder(specs, target, graph="training")
        self._eval_inputs = BatchBinder(specs, target, graph="eval")
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        self._bind_views(parameter_views(session))
        return session

    def _bind_views(self, views: list[ParameterView]) -> None:
        grads = []
        for view in views:
            owner, leaf = self._owner_of(view.name)
            if view.name in self.artifacts.manifest.buffers:
                owner.register_buffer(leaf, view.data)
                continue
            parameter = owner._parameters.get(leaf)
            if parameter is None:
                parameter = torch.nn.Parameter(view.data, requires_grad=view.trainable)
                owner.register_parameter(leaf, parameter)
            else:
                parameter.data = view.data
            if view.grad is not None:
                parameter.grad = view.grad
                grads.append(view.grad)
        self._grads = grads

    def _owner_of(self, name: str) -> tuple[torch.nn.Module, str]:
        """Return the (created on demand) submodule holding `name` and the leaf name."""
        *path, leaf = name.split(".")
        owner: torch.nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                if hasattr(owner, part):
                    raise ConfigurationError(
                        f"Parameter {name!r} clashes with the attribute {part!r} of {type(owner).__name__}; "
                        "rename that submodule of the torch model and export it again."
                    )
                child = torch.nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner, leaf

    # ----------------------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        """Leave the ORT objects out (they do not pickle); `__setstate__` rebuilds them."""
        state = super().__getstate__()
        for key in _UNPICKLED:
            state.pop(key, None)
        state["_ort_device"] = self._session.device
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the ORT objects from the artifacts, then restore the pickled parameter values."""
        device = state.pop("_ort_device")
        super().__setstate__(state)
        values = self._values()
        self._session = self._assemble(device)
        self._load_values(values)

    def _values(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in (*self.parameters(), *self.buffers())]

    @torch.no_grad()
    def _load_values(self, values: list[torch.Tensor]) -> None:
        for tensor, value in zip((*self.parameters(), *self.buffers()), values, strict=True):
            tensor.copy_(value)

    def _views_attached(self) -> bool:
        """Tell whether every parameter and buffer still shares memory with ORT's state."""
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return all(
            view.name not in tensors or tensors[view.name].data_ptr() == view.data.data_ptr()
            for view in parameter_views(self._session)
        )

    # ----------------------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str) -> None:
        """Refuse a Trainer precision other than ``"32-true"``, or a parallel strategy other than ``"ort_ddp"``."""
        check_strategy(self.trainer.strategy)
        precision = str(self.trainer.precision)
        if precision != _SUPPORTED_PRECISION:
            raise ConfigurationError(
                f"ORT training graphs run in float32, but the Trainer has precision={precision!r}; "
                f"use Trainer(precision={_SUPPORTED_PRECISION!r})."
            )

    def configure_model(self) -> None:
        """Rebuild the ORT components on the trainer's root device when it is not theirs.

        The module's current values are kept. Views that were replaced by copies (Lightning's
        spawn launcher clones every parameter's ``.data`` on CPU) are attached to ORT's state again.
        """
        device = _device_string(self.trainer.strategy.root_device)
        if device == self._session.device and self._views_attached():
            return
        values = self._values()
        if device != self._session.device:
            self._session = self._assemble(device)
        else:
            self._bind_views(parameter_views(self._session))
        self._load_values(values)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the eval graph on model inputs; return its model outputs as torch tensors.

        Labels are not needed: placeholders fill the label inputs (the loss is discarded).
        """
        fetches = self._session.eval_step(self._eval_inputs([*inputs, *self._label_placeholders(inputs)]))
        outputs = tuple(to_torch(fetches[i]) for i in range(1, len(fetches)))
        return outputs[0] if len(outputs) == 1 else outputs

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Forward and backward in ORT; gradients land in ORT's buffers. Logs ``train_loss``."""
        fetches = self._session.train_step(self._train_inputs(batch))
        loss = to_torch(fetches[0])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Run the eval graph and log ``val_loss``."""
        fetches = self._session.eval_step(self._eval_inputs(batch))
        loss = to_torch(fetches[0])
        self.log("val_loss", loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return the model outputs for a batch of model inputs (labels, if present, are ignored)."""
        count = len(self.artifacts.manifest.inputs)
        if isinstance(batch, dict):
            return self(*(batch[spec.name] for spec in self.artifacts.manifest.inputs))
        if isinstance(batch, torch.Tensor):
            return self(batch)
        return self(*batch[:count])

    def configure_optimizers(self) -> Any:
        """Return the ORT optimizer and ORT's linear warmup/decay schedule, stepped per optimizer step."""
        optimizer = ORTOptimizer(
            self._session, (p for p in self.parameters() if p.requires_grad), lr=self.lr
        )
        total = self._total_steps()
        warmup = self.warmup_steps
        warmup_steps = round(warmup * total) if isinstance(warmup, float) and warmup < 1 else int(warmup)
        scheduler = LinearLRSchedule(optimizer, warmup_steps=warmup_steps, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler: Any, metric: Any | None) -> None:
        """Step ORT's schedule (Lightning only steps torch schedulers by itself)."""
        if isinstance(scheduler, LinearLRSchedule):
            scheduler.step()
        else:
            super().lr_scheduler_step(scheduler, metric)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Keep the ``.grad`` views of ORT's gradient buffers (ORT resets them after each update).

        ``nn.Module.zero_grad`` would set them to None, cutting them from ORT's buffers; the
        trainer calls it before training.
        """

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Do nothing: ORT computed the gradients in ``training_step``."""

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any | None = None
    ) -> None:
        """Step the optimizer; under ``accumulate_grad_batches=N`` average ORT's summed gradients first.

        ORT sums gradients over micro-batches, Lightning expects their mean; the scaling runs
        inside the closure, so gradient clipping sees the averaged gradients.
        """
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate > 1 and optimizer_closure is not None:
            optimizer_closure = _averaging(optimizer_closure, self._grads, 1.0 / accumulate)
        optimizer.step(closure=optimizer_closure)

    # ----------------------------------------------------------------------------- helpers
    def _total_steps(self) -> int:
        if self.total_steps is not None:
            return int(self.total_steps)
        estimated = self.trainer.estimated_stepping_batches
        if estimated == float("inf"):
            raise ConfigurationError(
                "The Trainer cannot estimate the number of optimizer steps (infinite dataloader and no "
                "max_steps); pass ORTLightningModule(total_steps=...) or set Trainer(max_steps=...)."
            )
        return int(estimated)

    def _label_placeholders(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if not inputs:
            raise BatchError(
                f"forward() expects the model inputs {[s.name for s in self.artifacts.manifest.inputs]}, got none."
            )
        batch = inputs[0].shape[0]
        cached = self._placeholders.get(batch)
        if cached is None:
            device = torch_device(self._session.device)
            cached = [_placeholder(spec, batch, device) for spec in self.artifacts.manifest.labels]
            self._placeholders[batch] = cached
        return cached


def _placeholder(spec: TensorSpec, batch: int, device: torch.device) -> torch.Tensor:
    symbolic = [dim for dim in spec.shape[1:] if isinstance(dim, str) or dim <= 0]
    if symbolic:
        raise BatchError(
            f"forward() cannot invent label {spec.name!r} of shape {spec.shape}; run the eval graph with labels "
            "through validation_step, or export with fixed label dimensions."
        )
    shape = (batch, *(int(dim) for dim in spec.shape[1:])) if spec.shape else ()
    return torch.zeros(shape, dtype=spec.torch_dtype, device=device)


def _averaging(closure: Any, grads: list[torch.Tensor], scale: float) -> Any:
    def averaged() -> Any:
        result = closure()
        if grads:
            torch._foreach_mul_(grads, scale)
        return result

    return averaged


def _check_schedule(lr: float, warmup_steps: int | float, total_steps: int | None) -> None:
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigurationError(f"Expected argument `lr` to be a positive float, but got {lr!r}.")
    if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
        raise ConfigurationError(
            f"Expected argument `total_steps` to be a positive int or None, but got {total_steps!r}."
        )
    if isinstance(warmup_steps, float) and not warmup_steps.is_integer() and not 0 < warmup_steps < 1:
        raise ConfigurationError(
            f"Expected `warmup_steps` as a count (int >= 0) or a fraction in (0, 1), but got {warmup_steps!r}."
        )
    if warmup_steps < 0:
        raise ConfigurationError(f"Expected `warmup_steps` >= 0, but got {warmup_steps!r}.")
