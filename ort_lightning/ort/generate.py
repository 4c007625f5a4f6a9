"""Generating training artifacts with ONNX Runtime's ``generate_artifacts``, and the files a device ships."""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx

from ort_lightning.errors import ExportError
from ort_lightning.ort._api import (
    CheckpointState,
    bound_state,
    onnxblock,
    root_logger_kept,
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


#: The logger of ORT's ``.ort`` converter: one INFO line per ``*.required_operators.config`` it writes.
_CONVERTER_LOGGER = "ort_format_model.utils"


@contextlib.contextmanager
def _quiet_converter_log() -> Iterator[None]:
    # NOTE: ORT's tools set their loggers to DEBUG; its "Created config in ..." lines would reach any
    # handler the user gave the root logger. Warnings and errors still pass; the level comes back after.
    logger = logging.getLogger(_CONVERTER_LOGGER)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with root_logger_kept():
            yield
    finally:
        logger.setLevel(level)


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


def _stand_in(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """An initializer with `tensor`'s name, type and shape whose data is one element of zeros.

    NOTE: ORT's generator checks the model in memory and refuses external data; its path-based flow
    loses the external data of every loss block after the first (microsoft/onnxruntime#22411). It
    reads only names, types and shapes, so one element stands in; the checkpoint is written from the
    real data (`_checkpoint_from`).
    """
    stand_in = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
    stand_in.raw_data = bytes(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize)
    return stand_in


def _weightless(model: onnx.ModelProto, state: set[str]) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy of `model` whose external state initializers are stand-ins, and those initializers by name."""
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    external: dict[str, onnx.TensorProto] = {}
    for index, tensor in enumerate(copied.graph.initializer):
        if tensor.name in state and tensor.data_location == onnx.TensorProto.EXTERNAL:
            external[tensor.name] = onnx.TensorProto()
            external[tensor.name].CopyFrom(tensor)
            copied.graph.initializer[index].CopyFrom(_stand_in(tensor))
    return copied, external


@contextlib.contextmanager
def _checkpoint_from(weights_dir: Path, external: dict[str, onnx.TensorProto]) -> Iterator[None]:
    """While generating, write the checkpoint's stand-ins from their external data in `weights_dir`.

    NOTE: swapping ``onnxblock.save_checkpoint`` for one generation is the only hook; ORT's writer
    reads absolute external data tensor by tensor, without holding it all in memory.
    """
    original = onnxblock.save_checkpoint

    def serialized(tensor: onnx.TensorProto) -> bytes:
        source = external.get(tensor.name)
        if source is None:
            return tensor.SerializeToString()
        located = onnx.TensorProto()
        located.CopyFrom(source)
        for entry in located.external_data:
            if entry.key == "location":
                entry.value = os.fspath((weights_dir / entry.value).resolve())
        return located.SerializeToString()

    def save(parameters: Any, path: Any, nominal_checkpoint: bool = False) -> None:
        trainable, frozen = ([serialized(tensor) for tensor in group] for group in parameters)
        _C.save_checkpoint(trainable, frozen, os.fspath(path), nominal_checkpoint)

    onnxblock.save_checkpoint = save
    try:
        yield
    finally:
        onnxblock.save_checkpoint = original


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
    weights_dir: Path | None = None,
) -> None:
    """Write training, eval and optimizer graphs and the checkpoint with ORT's generator.

    Args:
        model: the forward `onnx.ModelProto`, parameters as initializers.
        trainable: initializers that get gradients.
        frozen: initializers kept in the checkpoint state without gradients.
        loss: a loss name, an `onnxblock.Block`, a function ``(model, output) -> loss name``, or None
            when the model's first output is the loss.
        optimizer: ``"adamw"`` or ``"sgd"``.
        optimizer_options: the normalized hyper-parameters of `optimizer`.
        directory: where the four artifacts go.
        extra_outputs: model outputs kept as graph outputs next to the loss.
        loss_inputs: model outputs fed to the loss (None: all of them).
        weights_dir: where `model`'s weights lie as external data, if they do.

    Raises:
        ExportError: when ORT cannot build the gradient graph.
    """
    loss_block = _loss_block(loss)
    external: dict[str, onnx.TensorProto] = {}
    if weights_dir is not None:
        model, external = _weightless(model, {*trainable, *frozen})
    try:
        checkpoint = _checkpoint_from(weights_dir, external) if weights_dir is not None else contextlib.nullcontext()
        with _quiet_graph_builder(), checkpoint, root_logger_kept():
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
    """Write the ``.ort`` graphs and ``nominal_checkpoint`` as ORT's generator would, from the final graphs."""
    if ort_format:
        # NOTE: the converter prints its progress, and its config writer logs each file at INFO; a library
        # keeps the user's console quiet (`_quiet_converter_log`).
        with contextlib.redirect_stdout(io.StringIO()), _quiet_graph_builder(), _quiet_converter_log():
            for graph in graphs:
                _converter.convert_onnx_models_to_ort(
                    Path(graph), output_dir=Path(folder), optimization_styles=[_converter.OptimizationStyle.Fixed]
                )
    if nominal_checkpoint:
        state = bound_state(CheckpointState.load_checkpoint(os.fspath(checkpoint)))
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

        >>> optimizer_kind_of(["AdamWOptimizer"]), optimizer_kind_of(["SGDOptimizerV2"])
        ('adamw', 'sgd')
    """
    for op_type in nodes:
        if op_type in OPTIMIZER_NODES:
            return OPTIMIZER_NODES[op_type]
    return None
