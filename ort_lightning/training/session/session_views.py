"""`SessionViews`: one module's ORT session and the torch views of its memory, built and rebuilt together.

`ORTLightningModule` holds one `SessionViews`. Building it assembles ONNX Runtime's
CheckpointState, Module and Optimizer, registers the ORT parameters (and buffers) on the module
as torch tensors that share ORT's memory, and prepares the batch binders of both graphs. The
same object answers the questions that follow the module through Lightning: is it still
attached to ORT's memory (Lightning's spawn launcher replaces ``.data`` with copies), and what
of it pickles (nothing: ONNX Runtime's objects do not pickle, so a module is pickled without
it, with the device to rebuild it on, and `values_of` / `load_values` carry the values across).

Example::

    >>> import copy, tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp()))
    >>> twin = copy.deepcopy(module)
    >>> torch.equal(twin.weight, module.weight), twin.weight.data_ptr() != module.weight.data_ptr()
    (True, True)
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import check_shapes, flat_values, state_specs
from ort_lightning.bridge import BatchBinder, ParameterView, label_placeholder, parameter_views, torch_device
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.session.parameters import GradientViews, bind_views

__all__ = [
    "DEVICE_KEY",
    "SessionViews",
    "load_values",
    "picklable",
    "snapshot",
    "start_checkpoint",
    "state_values",
    "values_of",
]

#: Where a module's pickle says which device its ORT objects ran on.
DEVICE_KEY = "_ort_device"


def start_checkpoint(artifacts: TrainingArtifacts, checkpoint: Path | None, *, weights_given: bool) -> Path:
    """The ORT checkpoint a session starts from: `checkpoint`, else the artifacts' own (a `weightless` one's nominal).

    Raises:
        ConfigurationError: for a `weightless` folder without `checkpoint` and without weights given.
    """
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
def snapshot(session: _ort.TrainingSession, *, include_optimizer_state: bool) -> Iterator[Path]:
    """Yield a temporary ORT checkpoint file of `session` (to rebuild it elsewhere, or afresh)."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
        path = Path(folder) / "state"
        _ort.save_checkpoint(session, path, include_optimizer_state=include_optimizer_state)
        yield path


class SessionViews:
    """The ORT components of one module, the torch views of their memory and the batch binders.

    Args:
        module: the module the ORT parameters are registered on, under the torch model's names.
        artifacts: what to build from.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        checkpoint: the ORT checkpoint to start from; None means the artifacts' own.
        spinning: whether ORT's worker threads spin between steps.
        intra_op_threads: the size of ORT's intra-op pool; 0 for ORT's default.
        custom_op_library: a shared library of custom operators to register with ONNX Runtime.
        values: name -> tensor for every state tensor (`ort_lightning.artifacts.state.state_specs`),
            copied into ORT's state before the views are bound, in place of the checkpoint's
            weights; with a nominal `checkpoint` (no weights) they are the only weights there are.

    Raises:
        ConfigurationError: for `values` with missing, unexpected, misshapen or non-float32 tensors, or
            none for a `weightless` folder without a `checkpoint`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        artifacts: TrainingArtifacts,
        *,
        device: str,
        checkpoint: Path | None = None,
        spinning: bool = True,
        intra_op_threads: int = 0,
        custom_op_library: str | None = None,
        values: Mapping[str, object] | None = None,
    ) -> None:
        self.artifacts = artifacts
        self.custom_op_library = custom_op_library
        start = start_checkpoint(artifacts, checkpoint, weights_given=values is not None)
        self.session = _ort.assemble(
            training_model=artifacts.training_model,
            eval_model=artifacts.eval_model,
            optimizer_model=artifacts.optimizer_model,
            checkpoint=start,
            device=device,
            custom_op_library=custom_op_library,
            spinning=spinning,
            intra_op_threads=intra_op_threads,
            parameters=None if values is None else flat_values(values, state_specs(artifacts)),
        )
        self.device = torch_device(self.session.device)
        specs = artifacts.manifest.graph_inputs
        self.train_inputs = BatchBinder(specs, self.device, graph="training")
        self.eval_inputs = BatchBinder(specs, self.device, graph="eval")
        self._placeholders: dict[int, list[torch.Tensor]] = {}
        views = self._views()
        # NOTE: once per build, from the views at hand: ORT itself would refuse other shapes only at the first step.
        check_shapes({view.name: tuple(view.data.shape) for view in views}, state_specs(artifacts), source=start,
                     artifacts=artifacts)
        #: Top-level names of the module's children that hold ORT's parameters (not torch's own).
        self.ort_children = {view.name.split(".")[0] for view in views if "." in view.name}
        self.gradients: GradientViews = bind_views(module, views, artifacts.manifest.buffers)
        # NOTE: bound once here, so that the per-step path looks nothing up.
        self.train_step = self.session.train_step
        self.eval_step = self.session.eval_step

    def rebuilt(
        self, module: torch.nn.Module, *, device: str | None = None, spinning: bool | None = None,
        intra_op_threads: int | None = None, checkpoint: Path | None = None, include_optimizer_state: bool = True,
    ) -> SessionViews:
        """A new `SessionViews` from `checkpoint`, else from a snapshot of this one's current state.

        Args:
            module: the module to register the new views on.
            device: where to build; None keeps this one's device.
            spinning: whether ORT's threads spin; None keeps this one's choice.
            intra_op_threads: the size of ORT's intra-op pool; None keeps this one's.
            checkpoint: the ORT checkpoint to build from; None snapshots this session.
            include_optimizer_state: with a snapshot, keep the optimizer's step and moments.
        """
        with contextlib.ExitStack() as stack:
            if checkpoint is None:
                # NOTE: a rebuild on another device keeps the training progress of the running session.
                kept = snapshot(self.session, include_optimizer_state=include_optimizer_state)
                checkpoint = stack.enter_context(kept)
            return SessionViews(
                module, self.artifacts, checkpoint=checkpoint,
                device=self.session.device if device is None else device,
                spinning=self.session.spinning if spinning is None else spinning,
                intra_op_threads=self.session.intra_op_threads if intra_op_threads is None else intra_op_threads,
                custom_op_library=self.custom_op_library,
            )

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
        """Run the eval graph on the model inputs of `batch` (labels filled in); return the fetches.

        Raises:
            BatchError: for a batch the eval graph cannot take, in one line (see
                `ort_lightning.bridge.BatchBinder.model_inputs`).
        """
        count = len(self.artifacts.manifest.inputs)
        tensors = self.eval_inputs.model_inputs(batch, count, entry=entry, labels_allowed=labels_allowed)
        rows = tensors[0].shape[0] if tensors and tensors[0].dim() else 1
        return self.eval_inputs.run(self.eval_step, [*tensors, *self.label_placeholders(rows)])

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


def picklable(state: dict[str, Any], views_key: str, session_views: SessionViews) -> dict[str, Any]:
    """A module's ``__dict__`` without its `SessionViews` (under `views_key`), with the device to rebuild on."""
    state = dict(state)
    state.pop(views_key, None)
    state[DEVICE_KEY] = session_views.session.device
    return state


def state_values(module: torch.nn.Module, artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """Name -> copy of every state tensor of `artifacts` that `module` holds (ORT's parameters and buffers)."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {spec.name: tensors[spec.name].detach().clone() for spec in state_specs(artifacts)}


def values_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of every parameter and buffer, to load into rebuilt ORT objects."""
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


@torch.no_grad()
def load_values(module: torch.nn.Module, values: list[torch.Tensor]) -> None:
    """Copy what `values_of` returned into the module's (ORT-backed) parameters and buffers."""
    for tensor, value in zip((*module.parameters(), *module.buffers()), values, strict=True):
        tensor.copy_(value)
