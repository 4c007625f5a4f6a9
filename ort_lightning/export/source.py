"""The source stage of export: a torch module or an ONNX model becomes the forward graph.

Pure functions over `onnx.ModelProto`s and files; no ONNX Runtime import here.

Example::

    >>> import torch
    >>> proto = torch_to_onnx(torch.nn.Linear(3, 2), (torch.zeros(4, 3),), input_names=["x"])
    >>> [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    (['x'], ['logits'])
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import onnx
import torch

from ort_lightning.errors import ExportError
from ort_lightning.export import symbolics as _symbolics
from ort_lightning.export.diagnose import conversion_error
from ort_lightning.export.external import attach_weights, externalize
from ort_lightning.export.model_io import copy_sharing_parameters, plan_io, strip_prefix, users_model
from ort_lightning.export.onnx_nodes import is_ai_onnx
from ort_lightning.export.weights import split_initializers
from ort_lightning.ort import limits
from ort_lightning.ort.graph_files import load_graph

#: What `export_artifacts` takes as a model.
ModelSource = Union[torch.nn.Module, onnx.ModelProto, str, "os.PathLike[str]"]

__all__ = [
    "OPSET",
    "ModelSource",
    "describe_source",
    "load_source",
    "buffer_inputs_of",
    "check_opset",
    "default_input_names",
    "default_output_names",
    "torch_to_onnx",
]

#: The opset the torch exporter writes: new enough for every op we use, within limits.MAX_OPSET.
OPSET = 17


def default_input_names(count: int) -> list[str]:
    """Return ``["input"]`` for one input, else ``["input_0", "input_1", ...]``."""
    return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]


def default_output_names(count: int, *, model_returns_loss: bool) -> list[str]:
    """Name a model's outputs: the first is ``"loss"`` or ``"logits"``, then ``output_1`` ..."""
    first = "loss" if model_returns_loss else "logits"
    return [first] + [f"output_{i}" for i in range(1, count)]


def _output_rows(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> list[int | None]:
    """The first dimension of each output at the example batch (None for a scalar)."""
    with torch.no_grad():
        outputs = model(*example_inputs)
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    return [int(out.shape[0]) if isinstance(out, torch.Tensor) and out.dim() else None for out in outputs]


def _dynamic_axes(
    input_names: Sequence[str], output_names: Sequence[str], rows: Sequence[int | None], batch: int
) -> dict[str, dict[int, str]]:
    """``batch`` for every input and output of the batch's size, ``batch*K`` for K rows per sample.

    NOTE: an output of B*T rows (``logits.view(-1, V)``) must not share the batch's symbol: ORT's
    Reshape gradient would fail at every batch size but the example's.
    """
    axes = {name: {0: "batch"} for name in input_names}
    for name, size in zip(output_names, rows, strict=True):
        if size is None:
            continue
        if size == batch:
            axes[name] = {0: "batch"}
        elif batch and size % batch == 0:
            axes[name] = {0: f"batch*{size // batch}"}
        else:
            axes[name] = {0: f"{name}_rows"}
    return axes


def torch_to_onnx(
    model: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    input_names: Sequence[str],
    model_returns_loss: bool = False,
    output_names: Sequence[str] | None = None,
    directory: Path | None = None,
) -> onnx.ModelProto:
    """Export `model` in training mode with a dynamic batch dimension, parameters under torch names.

    A copy is traced, so the caller's BatchNorm statistics stay. With a `directory` the weights go
    there as external data straight from the module's tensors (no copy of a 2 GB model in memory).

    Raises:
        ExportError: when torch cannot export the model.
    """
    # NOTE: the TorchScript exporter, not dynamo: dynamo folds BatchNorm into Conv (its
    # parameters vanish) and emits Dropout without the mask the gradient builder needs.
    model = copy_sharing_parameters(model).train()
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.named_buffers()}
    rows = _output_rows(copy_sharing_parameters(model), example_inputs)
    if output_names is None:
        output_names = default_output_names(len(rows), model_returns_loss=model_returns_loss)
    if model_returns_loss:  # a loss output is a scalar: it has no batch dimension to make dynamic
        rows[0] = None
    dynamic_axes = _dynamic_axes(input_names, output_names, rows, int(example_inputs[0].shape[0]))
    buffer = io.BytesIO()
    try:
        # NOTE: symbolics for layers torch's exporter refuses at this opset (RMSNorm, Dropout2d...). Without
        # autograd: the trace records the same graph, and the exporter keeps the traced outputs to its end,
        # which with autograd on held every activation of the forward (0.3 GiB for a 540 MB Llama).
        with warnings.catch_warnings(), _symbolics.registered(OPSET), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                example_inputs,
                # NOTE: torch types `f` as a path, but the TorchScript exporter writes to any
                # binary file object; a buffer spares a temporary file.
                buffer,  # type: ignore[arg-type]
                dynamo=False,
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
                export_params=directory is None,
                opset_version=OPSET,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_axes=dynamic_axes,
            )
    except Exception as error:  # torch raises many types here; all mean "cannot export"
        users, prefix = users_model(model)
        raise conversion_error(error, users, prefix=prefix, opset=OPSET) from error
    proto = onnx.load_from_string(buffer.getvalue())
    if directory is None:
        _restore_initializers(proto, state)
    else:
        attach_weights(proto, {**dict(model.named_parameters()), **state}, directory)
    return proto


def _restore_initializers(proto: onnx.ModelProto, state: dict[str, torch.Tensor]) -> None:
    """Overwrite initializers named like `state` entries with those values.

    NOTE: the TorchScript exporter records BatchNorm statistics after its training-mode trace.
    """
    for index, initializer in enumerate(proto.graph.initializer):
        tensor = state.get(initializer.name)
        if tensor is None or tuple(tensor.shape) != tuple(initializer.dims):
            continue
        restored = onnx.numpy_helper.from_array(tensor.numpy(), initializer.name)
        if restored.data_type == initializer.data_type:
            proto.graph.initializer[index].CopyFrom(restored)


def buffer_inputs_of(proto: onnx.ModelProto) -> set[str]:
    """Return initializers used as BatchNormalization running statistics (never trained)."""
    initializers = {tensor.name for tensor in proto.graph.initializer}
    names: set[str] = set()
    for node in proto.graph.node:
        if node.op_type == "BatchNormalization":
            names.update(name for name in node.input[3:5] if name in initializers)
    return names


def check_opset(proto: onnx.ModelProto, source: str) -> None:
    """Refuse a model whose ai.onnx opset is newer than ORT 1.19.2 reads (`ExportError`)."""
    for opset in proto.opset_import:
        if is_ai_onnx(opset) and opset.version > limits.MAX_OPSET:
            raise ExportError(
                f"{source} uses ai.onnx opset {opset.version}, but ONNX Runtime 1.19.2 reads opset <= "
                f"{limits.MAX_OPSET}; re-export it with opset_version={OPSET} (torch.onnx.export) or convert it "
                "with onnx.version_converter."
            )


def load_source(
    model: ModelSource,
    example_inputs: Any,
    input_names: Sequence[str] | None,
    model_returns_loss: bool,
    output: str | None = None,
    *,
    weights_dir: Path | None = None,
) -> tuple[onnx.ModelProto, set[str], set[str]]:
    """The source stage: the forward graph, its parameter initializers and its buffer initializers.

    Raises:
        ExportError: for a model that is not a module, a ModelProto or a readable ONNX file, or an
            opset newer than ORT reads.
    """
    proto, parameters, buffers, source_dir = _forward_graph(
        model, example_inputs, input_names, model_returns_loss, output, weights_dir=weights_dir
    )
    check_opset(proto, describe_source(model))
    if weights_dir is not None:
        externalize(proto, parameters | buffers, weights_dir, source_dir=source_dir)
    return proto, parameters, buffers


def _forward_graph(
    model: ModelSource,
    example_inputs: Any,
    input_names: Sequence[str] | None,
    model_returns_loss: bool,
    output: str | None = None,
    *,
    weights_dir: Path | None = None,
) -> tuple[onnx.ModelProto, set[str], set[str], Path | None]:
    """The forward graph, its parameter and buffer initializers, and the folder its external data lies in."""
    if isinstance(model, torch.nn.Module):
        plan = plan_io(
            model, example_inputs, input_names=input_names, output=output, model_returns_loss=model_returns_loss
        )
        names = plan.input_names or default_input_names(len(plan.inputs))
        proto = torch_to_onnx(
            plan.module, plan.inputs, input_names=names, model_returns_loss=model_returns_loss,
            output_names=plan.output_names, directory=weights_dir,
        )
        if plan.prefix:
            strip_prefix(proto, plan.prefix)
        initializers = {tensor.name for tensor in proto.graph.initializer}
        parameters = {name for name, _ in model.named_parameters()} & initializers
        buffers = {name for name, _ in model.named_buffers()} & initializers
        return proto, parameters, buffers, weights_dir
    proto, source_dir = _onnx_graph(model, external=weights_dir is not None)
    buffers = buffer_inputs_of(proto)
    weights, _ = split_initializers(proto, buffers=buffers)
    return proto, set(weights), buffers, source_dir


def _onnx_graph(model: ModelSource, *, external: bool) -> tuple[onnx.ModelProto, Path | None]:
    """A copy of an ONNX source, and the folder its external data lies in (a file's own folder)."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        return proto, None
    if not isinstance(model, (str, os.PathLike)):
        raise ExportError(
            "Expected `model` to be a torch.nn.Module, an onnx.ModelProto or the path of an ONNX file, "
            f"but got {type(model).__name__}."
        )
    if not Path(model).is_file():
        raise ExportError(f"ONNX file {model} does not exist; pass the path of an exported .onnx model.")
    advice = "pass a file written by torch.onnx.export or onnx.save"
    return load_graph(model, advice=advice, load_external_data=not external, error=ExportError), Path(model).parent


def describe_source(model: ModelSource) -> str:
    """Name a model source in messages: a class name, a file path, or the ONNX graph's name."""
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    if isinstance(model, onnx.ModelProto):
        return f"ONNX model (graph {model.graph.name!r})"
    return os.fspath(model)
