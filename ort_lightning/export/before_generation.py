"""Passes over the forward graph before ONNX Runtime builds the training graphs from it.

In order (`prepare`): the IR version ORT reads, the optional outputs ORT's gradients read, the
training mode of a torch model's attention Dropouts, then legalization.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch

from ort_lightning.export.legalize import engine as _legalize
from ort_lightning.export.onnx_nodes import is_ai_onnx
from ort_lightning.ort.limits import lower_ir_version

__all__ = ["add_dropout_masks", "add_dropout_training_mode", "add_log_prob_outputs", "prepare"]

#: The initializer that switches on the Dropouts the exporter wrote without a training mode.
TRAINING_MODE = "ort_lightning_dropout_training_mode"


def prepare(proto: onnx.ModelProto, *, model: object, weights_dir: Path | None = None) -> None:
    """Run the passes before generation on `proto`, in place (`model`: a torch source's module, for padding rows)."""
    lower_ir_version(proto)
    add_log_prob_outputs(proto)
    add_dropout_masks(proto)
    if isinstance(model, torch.nn.Module):
        add_dropout_training_mode(proto)
    _legalize.legalize(proto, padding_rows=_legalize.padding_rows_of(model), weights_dir=weights_dir)


def add_log_prob_outputs(proto: onnx.ModelProto) -> int:
    """Give every SoftmaxCrossEntropyLoss its optional ``log_prob`` output, which ORT's gradient reads."""
    return _add_second_output(proto, "SoftmaxCrossEntropyLoss", "log_prob")


def add_dropout_masks(proto: onnx.ModelProto) -> int:
    """Give every Dropout its optional ``mask`` output (ORT's gradient reads it); return how many changed.

    Example::

        >>> import onnx
        >>> node = onnx.helper.make_node("Dropout", ["x"], ["y"])
        >>> proto = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [], []))
        >>> add_dropout_masks(proto), [list(n.output) for n in proto.graph.node]
        (1, [['y', 'Dropout_0_mask']])
    """
    return _add_second_output(proto, "Dropout", "mask")


def add_dropout_training_mode(proto: onnx.ModelProto) -> int:
    """Give a torch model's Dropouts with a ratio but no ``training_mode`` the training mode; return how many.

    The exporter writes attention dropout with the ratio alone, and ONNX's default mode is off: ORT
    would train without the dropout torch trains with.
    """
    changed = 0
    for node in proto.graph.node:
        if node.op_type == "Dropout" and is_ai_onnx(node) and len(node.input) == 2 and node.input[1]:
            node.input.append(TRAINING_MODE)
            changed += 1
    if changed:
        proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), TRAINING_MODE))
    return changed


def _add_second_output(proto: onnx.ModelProto, op_type: str, suffix: str) -> int:
    """Name the optional second output of every ai.onnx `op_type` node written with one output."""
    taken = {name for node in proto.graph.node for name in node.output}
    changed = 0
    for index, node in enumerate(proto.graph.node):
        if node.op_type == op_type and is_ai_onnx(node) and len(node.output) == 1:
            name = f"{node.name or op_type}_{index}_{suffix}"
            while name in taken:
                name += "_"
            taken.add(name)
            node.output.append(name)
            changed += 1
    return changed


