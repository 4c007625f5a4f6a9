"""Generating training artifacts with ONNX Runtime's ``generate_artifacts``.

With our loss and optimizer blocks, and the files a device ships (``.ort`` graphs, a nominal
checkpoint).

Example::

    >>> optimizer_kind_of(["SGDOptimizerV2"])
    'sgd'
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx

from ort_lightning.errors import ExportError
from ort_lightning.ort._api import (
    CheckpointState,
    onnxblock,
)
from ort_lightning.ort._api import artifacts_api as _artifacts
from ort_lightning.ort._api import capi as _C
from ort_lightning.ort._api import ort_converter as _converter
from ort_lightning.ort._api import training_graph_utils as _training_graph_utils
from ort_lightning.ort.options import session_options

__all__ = [
    "OPTIMIZER_NODES",
    "generate",
    "is_block",
    "optimizer_kind_of",
    "write_device_files",
]


#: Loss name -> onnxblock class; each adds a label input: ``labels`` (cross-entropy) or ``target``.
_LOSSES = {
    "cross_entropy": onnxblock.loss.CrossEntropyLoss,
    "mse": onnxblock.loss.MSELoss,
    "bce_with_logits": onnxblock.loss.BCEWithLogitsLoss,
    "l1": onnxblock.loss.L1Loss,
}


#: Optimizer graph node -> the optimizer kind used in the manifest.
OPTIMIZER_NODES = {"AdamWOptimizer": "adamw", "SGDOptimizerV2": "sgd"}


@contextlib.contextmanager
def _quiet_graph_builder() -> Iterator[None]:
    # NOTE: the gradient builder makes its own SessionOptions, whose session logger ignores the
    # default severity; swapping the factory for the duration of one build is the only knob.
    original = _training_graph_utils.SessionOptions
    _training_graph_utils.SessionOptions = session_options
    try:
        yield
    finally:
        _training_graph_utils.SessionOptions = original


def is_block(obj: object) -> bool:
    """Tell whether `obj` is an `onnxblock.Block` (a custom loss)."""
    return isinstance(obj, onnxblock.Block)


class _GraphLoss(onnxblock.Block):
    """Adapts a function ``(model, output) -> loss name`` that edits the graph to ORT's Block."""

    def __init__(self, build: Callable[[onnx.ModelProto, str], str]) -> None:
        super().__init__()
        self._build = build

    def build(self, output: str) -> str:
        return self._build(self.base, output)


def _loss_block(loss: str | Any | None) -> Any:
    if loss is None:
        return None
    if is_block(loss):
        return loss
    if callable(loss):
        return _GraphLoss(loss)
    return _LOSSES[loss]()


def _optimizer_block(kind: str, options: dict[str, Any]) -> Any:
    if kind == "sgd":
        return onnxblock.optim.SGD()
    return onnxblock.optim.AdamW(
        betas=tuple(options["betas"]), eps=options["eps"], weight_decay=options["weight_decay"]
    )


def generate(
    model: Any,
    *,
    trainable: Sequence[str],
    frozen: Sequence[str],
    loss: str | Any | None,
    optimizer: str,
    optimizer_options: dict[str, Any],
    directory: os.PathLike[str] | str,
    extra_outputs: Sequence[str],
    loss_inputs: Sequence[str] | None,
) -> None:
    """Write training, eval and optimizer graphs and the checkpoint with ORT's generator.

    Args:
        model: the forward `onnx.ModelProto`, parameters as initializers.
        trainable: initializers that get gradients.
        frozen: initializers kept in the checkpoint state without gradients.
        loss: a loss name, an `onnxblock.Block`, a function ``(model, output) -> loss name`` that
            appends the loss to the forward graph, or None when the model's first output is the loss.
        optimizer: ``"adamw"`` or ``"sgd"``.
        optimizer_options: the normalized hyper-parameters of `optimizer`.
        directory: where the four artifacts go.
        extra_outputs: model outputs kept as graph outputs next to the loss.
        loss_inputs: model outputs fed to the loss (None: all of them).

    Raises:
        ExportError: when ORT cannot build the gradient graph.
    """
    loss_block = _loss_block(loss)
    try:
        with _quiet_graph_builder():
            _artifacts.generate_artifacts(
                model,
                requires_grad=list(trainable),
                frozen_params=list(frozen),
                loss=loss_block,
                optimizer=_optimizer_block(optimizer, optimizer_options),
                artifact_directory=os.fspath(directory),
                additional_output_names=list(extra_outputs) or None,
                loss_input_names=list(loss_inputs) if loss_inputs else None,
            )
    except (RuntimeError, _C.Fail, _C.InvalidArgument, _C.InvalidGraph) as error:
        raise ExportError(
            f"ONNX Runtime could not build training graphs for this model: {error}. Check that every "
            "operator is differentiable by ORT 1.19.2 and that `loss` matches the model's outputs."
        ) from error


def write_device_files(
    folder: os.PathLike[str] | str,
    graphs: Sequence[os.PathLike[str] | str],
    checkpoint: os.PathLike[str] | str,
    *,
    ort_format: bool,
    nominal_checkpoint: bool,
) -> None:
    """Write what ``generate_artifacts(..., ort_format=True, nominal_checkpoint=True)`` writes, from final graphs.

    ``.ort`` graphs (and ``*.required_operators.config``) beside the `graphs`, as ORT's generator
    converts them (fixed optimization style); ``nominal_checkpoint`` beside `checkpoint`: its
    parameters' names, shapes and trainability, no weights.
    """
    if ort_format:
        # NOTE: the converter prints its progress; a library keeps the user's console quiet.
        with contextlib.redirect_stdout(io.StringIO()), _quiet_graph_builder():
            for graph in graphs:
                _converter.convert_onnx_models_to_ort(
                    Path(graph), output_dir=Path(folder), optimization_styles=[_converter.OptimizationStyle.Fixed]
                )
    if nominal_checkpoint:
        state = CheckpointState.load_checkpoint(os.fspath(checkpoint))._state
        trainable: list[bytes] = []
        frozen: list[bytes] = []
        for name in state.parameter_names():
            parameter = state.get_parameter(name)
            tensor = onnx.numpy_helper.from_array(parameter.data.numpy(), name)
            (trainable if parameter.requires_grad else frozen).append(tensor.SerializeToString())
        _C.save_checkpoint(trainable, frozen, os.fspath(Path(folder) / "nominal_checkpoint"), True)


def optimizer_kind_of(nodes: Sequence[str]) -> str | None:
    """Map the node types of an optimizer graph to ``"adamw"``, ``"sgd"`` or None.

    Example::

        >>> optimizer_kind_of(["AdamWOptimizer"])
        'adamw'
    """
    for op_type in nodes:
        if op_type in OPTIMIZER_NODES:
            return OPTIMIZER_NODES[op_type]
    return None
