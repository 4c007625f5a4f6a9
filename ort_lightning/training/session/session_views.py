"""`SessionViews`: one module's ORT session and the torch views of its memory, built together.

Building it assembles ORT's CheckpointState, Module and Optimizer, registers ORT's parameters on
the module as torch tensors over ORT's memory, and prepares both graphs' batch binders. ORT's
objects do not pickle: a module pickles without them and copies its values back by name.
Only `ort_lightning.training.session.live.LiveSession` builds it.

Example::

    >>> import copy, tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> twin = copy.deepcopy(module)
    >>> torch.equal(twin.weight, module.weight), twin.weight.data_ptr() != module.weight.data_ptr()
    (True, True)
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ort_lightning.artifacts import TensorSpec, TrainingArtifacts
from ort_lightning.artifacts.checks import read_graph
from ort_lightning.artifacts.state import check_shapes, flat_values, state_specs
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import BatchError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.guards import check_model_outputs
from ort_lightning.training.session.parameters import (
    GradientViews,
    ParameterView,
    bind_views,
    check_conversion,
    parameter_views,
)

__all__ = ["DEVICE_KEY", "SessionViews", "snapshot", "start_checkpoint", "state_values"]

#: Where a module's pickle says which device its ORT objects ran on.
DEVICE_KEY = "_ort_device"


def start_checkpoint(
    artifacts: TrainingArtifacts, checkpoint: Path | _ort.HeldState | None, *, weights_given: bool
) -> Path | _ort.HeldState:
    """The ORT checkpoint a session starts from: `checkpoint`, else the artifacts' own."""
    if checkpoint is not None:
        return checkpoint
    if not artifacts.weightless:
        return artifacts.checkpoint
    if not weights_given:
        raise ConfigurationError(
            f"{artifacts.directory} holds no weights: its only checkpoint is {artifacts.nominal_checkpoint} (names "
            "and shapes, what a device ships), so there is nothing to start from; pass the weights with "
            "ORTLightningModule(folder, values={name: tensor}) (e.g. ort_lightning.fleet.get_values(module) of a "
            "module built on the complete artifacts, as a fleet server sends them), or checkpoint= a complete ORT "
            "checkpoint of these artifacts."
        )
    nominal = artifacts.nominal_checkpoint
    assert nominal is not None  # a weightless folder is one whose only checkpoint is the nominal one
    return nominal


@contextlib.contextmanager
def snapshot(
    session: _ort.TrainingSession, *, include_optimizer_state: bool,
    properties: Mapping[str, int | float | str] | None = None,
) -> Iterator[Path]:
    """Yield a temporary ORT checkpoint file of `session`, with exactly `properties` (None: the state's)."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
        path = Path(folder) / "state"
        session.save(path, include_optimizer_state=include_optimizer_state, properties=properties)
        yield path


class SessionViews:
    """The ORT components of one module, the torch views of their memory and the batch binders.

    Args:
        module: the module the ORT parameters are registered on, under the torch model's names.
        artifacts: what to build from.
        settings: how the session runs; without the eval graph, `infer`, `predict` and `evaluate`
            need a rebuild with it.
        checkpoint: the ORT checkpoint to start from; None means the artifacts' own.
        values: name -> tensor for every state tensor, copied in place of the checkpoint's weights.

    Raises:
        ConfigurationError: for `values` with missing, unexpected, misshapen or non-float32 tensors,
            or none for a `weightless` folder without a `checkpoint`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        artifacts: TrainingArtifacts,
        *,
        settings: _ort.SessionSettings,
        checkpoint: Path | _ort.HeldState | None = None,
        values: Mapping[str, object] | None = None,
    ) -> None:
        self.artifacts = artifacts
        start = start_checkpoint(artifacts, checkpoint, weights_given=values is not None)
        self.session = _ort.assemble(
            training_model=artifacts.training_model,
            eval_model=artifacts.eval_model,
            optimizer_model=artifacts.optimizer_model,
            checkpoint=start,
            settings=settings,
            parameters=None if values is None else flat_values(values, state_specs(artifacts)),
            optimizer_kind=optimizer_kind(artifacts),
        )
        self.device = torch.device(self.session.device)
        specs = artifacts.manifest.graph_inputs
        self.train_inputs = BatchBinder(specs, self.device, graph="training")
        self.eval_inputs = BatchBinder(specs, self.device, graph="eval")
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        views = self._views()
        source = start.source if isinstance(start, _ort.HeldState) else start
        if source is not None:  # NOTE: a handed-over state was checked when it was first built
            # NOTE: once per build, from the views at hand: ORT itself would refuse other shapes only at the first step.
            check_shapes({view.name: tuple(view.data.shape) for view in views}, state_specs(artifacts),
                         source=Path(source), artifacts=artifacts)
        #: Top-level names of the module's children that hold ORT's parameters (not torch's own).
        self.ort_children = {view.name.split(".")[0] for view in views if "." in view.name}
        self.gradients: GradientViews = bind_views(module, views, artifacts.manifest.buffers)
        # NOTE: bound once here, so that the eval path looks nothing up (the training step is the step path's).
        self.eval_step = self.session.eval_step

    def reattach(self, module: torch.nn.Module) -> None:
        """Register ORT's memory on `module` again, after something replaced the views with copies."""
        self.gradients = bind_views(module, self._views(), self.artifacts.manifest.buffers)

    def attached(self, module: torch.nn.Module) -> bool:
        """Tell whether every parameter and buffer of `module` still shares memory with ORT's state."""
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        return all(
            view.name not in tensors or tensors[view.name].data_ptr() == view.data.data_ptr()
            for view in parameter_views(self.session)
        )

    def infer(self, batch: Any, *, entry: str, labels_allowed: bool) -> Any:
        """Run the eval graph on the model inputs of `batch` (labels filled in); return the fetches (`BatchError`)."""
        count = len(self.artifacts.manifest.inputs)
        tensors = self.eval_inputs.model_inputs(batch, count, entry=entry, labels_allowed=labels_allowed)
        rows = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
        return self.eval_inputs.run(self.eval_step, [*tensors, *self.label_placeholders(rows)])

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The module's trainable parameters (views of ORT's memory), in the model's order."""
        return [parameter for parameter, _ in self.gradients.pairs]

    def predict(self, batch: Any, *, entry: str, labels_allowed: bool) -> Any:
        """The model outputs for the model inputs of `batch`: one tensor, or a tuple of several.

        Raises:
            BatchError: for a batch the eval graph cannot take.
            ConfigurationError: for an eval graph whose only output is the loss.
        """
        outputs = self.outputs(self.infer(batch, entry=entry, labels_allowed=labels_allowed))
        return outputs[0] if len(outputs) == 1 else outputs

    def evaluate(self, batch: Any, labels: Any) -> tuple[Any, Any, torch.Tensor]:
        """Run the eval graph on a labelled `batch`; return its tensors, the fetches and the loss."""
        return self.eval_inputs.step(self.eval_step, batch, labels)

    def outputs(self, fetches: Any) -> tuple[torch.Tensor, ...]:
        """The model outputs of an eval step as torch tensors (`ConfigurationError` if the loss is all)."""
        check_model_outputs(self.artifacts, len(fetches))
        return tuple(to_torch(fetches[i]) for i in range(1, len(fetches)))

    def apply_beside(self, module: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool) -> None:
        """``module._apply(fn)`` on the torch-side children only (`ConfigurationError` for a dtype but float32)."""
        device = self.device
        try:
            check_conversion(fn, device)
            for name, child in module._modules.items():
                if name not in self.ort_children and child is not None:
                    child._apply(fn, recurse)
        finally:
            # NOTE: Lightning's .to()/.half() record the new device and dtype before calling
            # _apply; the module still lives where ORT runs it, in float32.
            module._device = device  # type: ignore[assignment]
            module._dtype = torch.float32  # type: ignore[assignment]

    def _views(self) -> list[ParameterView]:
        """ORT's parameters in the model's own order (the manifest's), not ORT's alphabetical one."""
        views = {view.name: view for view in parameter_views(self.session)}
        return [views[name] for name in self.artifacts.manifest.in_model_order(list(views))]

    def label_placeholders(self, batch: int) -> list[torch.Tensor]:
        """Labels of the right dtype and shape for `batch` rows, made once per batch size (forward needs none)."""
        cached = self._placeholders.get(batch)
        if cached is None:
            cached = [label_placeholder(spec, batch, self.device) for spec in self.artifacts.manifest.labels]
            self._placeholders[batch] = cached
        return cached


def optimizer_kind(artifacts: TrainingArtifacts) -> str | None:
    """What the optimizer graph runs, from the folder check's facts (None: `assemble` reads an ``.ort`` graph)."""
    path = artifacts.optimizer_model
    if path is None:
        return "none"
    if path.suffix != ".onnx":
        return None
    # NOTE: read_graph keeps the facts the folder check read, so that the graph is read once per process.
    kind = _ort.optimizer_kind_of(sorted(read_graph(path).op_types))
    return kind if kind is not None else _ort.optimizer_kind_in(path)


def state_values(module: torch.nn.Module, artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """Name -> copy of every state tensor of `artifacts` that `module` holds (ORT's parameters and buffers)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {spec.name: tensors[spec.name].detach().clone() for spec in state_specs(artifacts)}


def label_placeholder(spec: TensorSpec, batch: int, device: torch.device) -> torch.Tensor:
    """Zeros standing in for label `spec` on model inputs alone (`BatchError` for a symbolic dimension)."""
    symbolic = [dim for dim in spec.shape[1:] if isinstance(dim, str) or dim <= 0]
    if symbolic:
        raise BatchError(
            f"forward() cannot invent label {spec.name!r} of shape {spec.shape}; run the eval graph with labels "
            "through validation_step, or export with fixed label dimensions."
        )
    shape = (_rows(spec.shape[0], batch), *(int(dim) for dim in spec.shape[1:])) if spec.shape else ()
    return torch.zeros(shape, dtype=spec.torch_dtype, device=device)


def _rows(dim: int | str, batch: int) -> int:
    """Label rows for `batch` samples: ``batch*T`` (flattened per-position labels) is ``batch * T``."""
    factor = dim.partition("batch*")[2] if isinstance(dim, str) else ""
    return batch * int(factor) if factor.isdigit() else batch
