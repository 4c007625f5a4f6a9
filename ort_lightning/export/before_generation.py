"""Passes over the forward graph before ONNX Runtime builds the training graphs from it.

In order (`prepare`): the IR version ORT reads, the optional outputs whose gradients ORT reads
(``log_prob`` of SoftmaxCrossEntropyLoss, ``mask`` of Dropout), the training mode of the
attention Dropouts of a torch model, then legalization (every node ORT's gradient builder
cannot take, rewritten into an exact equivalent it can). All of them work on the in-memory
`onnx.ModelProto`, in place; weights kept as external data are read from their folder only
where a rewrite needs a value (an embedding's padding row).

Example::

    >>> import onnx
    >>> graph = onnx.helper.make_graph([onnx.helper.make_node("Dropout", ["x"], ["y"])], "g", [], [])
    >>> proto = onnx.helper.make_model(graph)
    >>> add_dropout_masks(proto), [list(n.output) for n in proto.graph.node]
    (1, [['y', 'Dropout_0_mask']])
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
    """Run the passes before generation on `proto`, in place, in their order.

    Args:
        proto: the forward graph (model inputs to model outputs).
        model: the torch module it came from (its embeddings' ``padding_idx`` guide the gather
            rewrites), or None for an ONNX source.
        weights_dir: where the external data of its weights lies (``export.external``), if any.
    """
    lower_ir_version(proto)
    add_log_prob_outputs(proto)
    add_dropout_masks(proto)
    if isinstance(model, torch.nn.Module):
        add_dropout_training_mode(proto)
    _legalize.legalize(proto, padding_rows=_legalize.padding_rows_of(model), weights_dir=weights_dir)


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


def add_dropout_training_mode(proto: onnx.ModelProto) -> int:
    """Give every Dropout with a ratio but no ``training_mode`` input the training mode; return how many changed.

    For a torch model only, which is exported in training mode: the exporter writes the Dropout
    of ``F.scaled_dot_product_attention(dropout_p=...)`` (``nn.MultiheadAttention``,
    ``nn.Transformer*Layer``, Hugging Face attention) with the ratio alone, and ONNX's default
    ``training_mode`` is false, so ORT would train with that dropout off while torch trains with
    it on. The eval graph turns every Dropout into an Identity as before.

    Example::

        >>> from onnx import helper
        >>> node = helper.make_node("Dropout", ["x", "p"], ["y", "mask"])
        >>> proto = helper.make_model(helper.make_graph([node], "g", [], []))
        >>> add_dropout_training_mode(proto), list(proto.graph.node[0].input)
        (1, ['x', 'p', 'ort_lightning_dropout_training_mode'])
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


