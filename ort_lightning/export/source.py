"""torch -> ONNX details: the exporter's settings and the graph fixes ORT 1.19.2 needs.

Pure functions over `onnx.ModelProto`s and files; no ONNX Runtime import here.

Example::

    >>> import torch
    >>> proto = torch_to_onnx(torch.nn.Linear(3, 2), (torch.zeros(4, 3),), input_names=["x"])
    >>> [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    (['x'], ['logits'])
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx
import torch

from ort_lightning import _symbolics
from ort_lightning.errors import ExportError

__all__ = [
    "MAX_IR_VERSION",
    "MAX_OPSET",
    "OPSET",
    "add_dropout_masks",
    "add_log_prob_outputs",
    "buffer_inputs_of",
    "check_opset",
    "default_input_names",
    "default_output_names",
    "fix_eval_graph",
    "lower_ir_version",
    "set_torch_adamw_mode",
    "torch_to_onnx",
]

#: The newest ONNX IR version and ai.onnx opset that ONNX Runtime 1.19.2 loads.
MAX_IR_VERSION = 10
MAX_OPSET = 21
#: The opset the torch exporter writes: new enough for every op we use, within MAX_OPSET.
OPSET = 17

_TRAINING_ONLY_OUTPUTS = ("BatchNormalization", "Dropout")


def default_input_names(count: int) -> list[str]:
    """Return ``["input"]`` for one input, else ``["input_0", "input_1", ...]``."""
    return ["input"] if count == 1 else [f"input_{i}" for i in range(count)]


def default_output_names(count: int, *, model_returns_loss: bool) -> list[str]:
    """Name a model's outputs: the first is ``"loss"`` or ``"logits"``, then ``output_1`` ...

    Example::

        >>> default_output_names(2, model_returns_loss=False)
        ['logits', 'output_1']
    """
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
    """``batch`` for every input and every output of the batch's size, ``batch*K`` for K rows per sample.

    NOTE: an output with other rows, such as a language model's ``logits.view(-1, V)`` of B*T
    rows, must not share the batch's symbol: ORT's gradient of the Reshape would then take the
    flattened rows for the batch and fail at every batch size but the example's. ``batch*T``
    also tells how many label rows a batch needs; rows that are no multiple of the batch get
    ``<output>_rows``.
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
) -> onnx.ModelProto:
    """Export `model` in training mode with a dynamic batch dimension, parameters under torch names.

    The model is copied first: tracing in training mode would otherwise update the caller's
    BatchNorm running statistics. The trace still updates the copy's, so the initializers are
    reset to the model's state as it was before the trace. `output_names` default to
    `default_output_names`.

    Raises:
        ExportError: when torch cannot export the model.
    """
    # NOTE: the TorchScript exporter, not dynamo: dynamo folds BatchNorm into Conv (its
    # parameters vanish) and emits Dropout without the mask the gradient builder needs.
    model = copy.deepcopy(model).train()
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    rows = _output_rows(copy.deepcopy(model), example_inputs)
    if output_names is None:
        output_names = default_output_names(len(rows), model_returns_loss=model_returns_loss)
    if model_returns_loss:  # a loss output is a scalar: it has no batch dimension to make dynamic
        rows[0] = None
    dynamic_axes = _dynamic_axes(input_names, output_names, rows, int(example_inputs[0].shape[0]))
    buffer = io.BytesIO()
    try:
        # NOTE: symbolics for layers torch's exporter refuses at this opset (RMSNorm, Dropout2d...).
        with warnings.catch_warnings(), _symbolics.registered(OPSET):
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
                export_params=True,
                opset_version=OPSET,
                input_names=list(input_names),
                output_names=list(output_names),
                dynamic_axes=dynamic_axes,
            )
    except Exception as error:  # torch raises many types here; all mean "cannot export"
        raise ExportError(
            f"torch.onnx.export failed for {type(model).__name__}: {error}. Check that `example_inputs` "
            "is what the model's forward takes, or export the model to ONNX yourself and pass the file."
        ) from error
    proto = onnx.load_from_string(buffer.getvalue())
    _restore_initializers(proto, state)
    return proto


def _restore_initializers(proto: onnx.ModelProto, state: dict[str, torch.Tensor]) -> None:
    """Overwrite initializers named like `state` entries with those values.

    NOTE: the TorchScript exporter runs the forward once in training mode and records the
    state after it, so each BatchNorm's running statistics arrive already updated by the
    example batch (running_mean = 0.1 * batch mean, running_var = 0.9 + ...).
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
    """Refuse a model whose ai.onnx opset is newer than ORT 1.19.2 reads.

    Raises:
        ExportError: naming the opset found and the limit.
    """
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            raise ExportError(
                f"{source} uses ai.onnx opset {opset.version}, but ONNX Runtime 1.19.2 reads opset <= "
                f"{MAX_OPSET}; re-export it with opset_version={OPSET} (torch.onnx.export) or convert it "
                "with onnx.version_converter."
            )


def add_log_prob_outputs(proto: onnx.ModelProto) -> int:
    """Give every SoftmaxCrossEntropyLoss its optional ``log_prob`` output; return how many changed.

    ORT's gradient of SoftmaxCrossEntropyLoss reads that second output, and the exporter emits
    the node without it (``F.cross_entropy`` inside a model's forward), so building the gradient
    graph fails. ORT's own CrossEntropyLoss block writes both outputs, as done here.
    """
    return _add_second_output(proto, "SoftmaxCrossEntropyLoss", "log_prob")


def add_dropout_masks(proto: onnx.ModelProto) -> int:
    """Give every Dropout its optional ``mask`` output; return how many changed.

    The exporter writes the Dropout of ``F.scaled_dot_product_attention(dropout_p=...)`` (the
    attention dropout of Hugging Face models) with one output, and ORT's Dropout gradient reads
    the mask, so building the gradient graph fails.
    """
    return _add_second_output(proto, "Dropout", "mask")


def _add_second_output(proto: onnx.ModelProto, op_type: str, suffix: str) -> int:
    """Name the optional second output of every ai.onnx `op_type` node written with one output."""
    taken = {name for node in proto.graph.node for name in node.output}
    changed = 0
    for index, node in enumerate(proto.graph.node):
        if node.op_type == op_type and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            name = f"{node.name or op_type}_{index}_{suffix}"
            while name in taken:
                name += "_"
            taken.add(name)
            node.output.append(name)
            changed += 1
    return changed


def lower_ir_version(proto: onnx.ModelProto) -> bool:
    """Stamp IR version `MAX_IR_VERSION` on a model that claims a newer one; True if changed.

    Newer onnx packages stamp IR 11+ on everything they write, even graphs that use nothing
    newer than IR 10, and ORT 1.19.2 refuses those files.
    """
    if proto.ir_version <= MAX_IR_VERSION:
        return False
    proto.ir_version = MAX_IR_VERSION
    return True


def _rewrite(path: Path, proto: onnx.ModelProto) -> None:
    lower_ir_version(proto)
    onnx.save(proto, path)


def fix_eval_graph(path: Path) -> None:
    """Make ``eval_model.onnx`` an inference graph that ORT can load.

    ORT's generator turns training mode off in the eval graph but keeps the training-only
    outputs (running statistics of BatchNormalization, the mask of Dropout), which ORT then
    refuses. Those outputs are trimmed and Dropout becomes an Identity.
    """
    proto = onnx.load(path)
    for node in proto.graph.node:
        if node.op_type in _TRAINING_ONLY_OUTPUTS:
            del node.output[1:]
        if node.op_type == "Dropout":
            node.op_type = "Identity"
            del node.input[1:]
            del node.attribute[:]
    _rewrite(path, proto)


def set_torch_adamw_mode(path: Path) -> None:
    """Switch the AdamW node of an optimizer graph to torch's decoupled weight decay.

    ORT's default ``adam_mode=1`` decays after the update (the Hugging Face variant);
    ``adam_mode=0`` decays before, as ``torch.optim.AdamW`` does.
    """
    proto = onnx.load(path)
    for node in proto.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0
    _rewrite(path, proto)


def lower_ir_versions(paths: Iterable[Path]) -> None:
    """Apply `lower_ir_version` to model files in place."""
    for path in paths:
        proto = onnx.load(path)
        if lower_ir_version(proto):
            onnx.save(proto, path)
