"""Passes over the forward graph before ONNX Runtime builds the training graphs from it.

In order (`prepare`): the IR version ORT reads, the optional outputs whose gradients ORT reads
(``log_prob`` of SoftmaxCrossEntropyLoss, ``mask`` of Dropout), then legalization (every node
ORT's gradient builder cannot take, rewritten into an exact equivalent it can). All of them work
on the in-memory `onnx.ModelProto`, in place; weights kept as external data are read from their
folder only where a rewrite needs a value (an embedding's padding row).

Example::

    >>> import onnx
    >>> graph = onnx.helper.make_graph([onnx.helper.make_node("Dropout", ["x"], ["y"])], "g", [], [])
    >>> proto = onnx.helper.make_model(graph)
    >>> add_dropout_masks(proto), [list(n.output) for n in proto.graph.node]
    (1, [['y', 'Dropout_0_mask']])
"""

from __future__ import annotations

from pathlib import Path

import onnx

from ort_lightning.export.legalize import engine as _legalize
from ort_lightning.export.onnx_nodes import is_ai_onnx
from ort_lightning.ort.limits import lower_ir_version

__all__ = ["add_dropout_masks", "add_log_prob_outputs", "prepare"]


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


