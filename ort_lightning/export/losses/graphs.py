"""ONNX subgraphs of torch's losses, built from ops whose gradients ONNX Runtime 1.19.2 has.

Pure functions over an `onnx.GraphProto`: each appends the label input, its initializers and
its nodes to the forward graph and returns the name of the scalar loss. ONNX Runtime's
generator then differentiates them like the rest of the model.

Why not ORT's own loss blocks: its CrossEntropyLoss puts the class axis last (torch's is
axis 1) and breaks on a ``weight`` array; it has no NLL, SmoothL1 or Huber loss (and no
gradient for ``NegativeLogLikelihoodLoss`` or ``Softplus``); its BCEWithLogitsLoss takes
``log(sigmoid(x))``, which overflows where torch's stable form does not.

Example::

    >>> import onnx
    >>> from onnx import TensorProto, helper
    >>> logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])
    >>> graph = helper.make_graph([], "g", [], [logits])
    >>> build_loss(graph, "mse", {"reduction": "mean"}, output="logits", label="target")
    'loss/mse/out'
    >>> [node.op_type for node in graph.node]
    ['Sub', 'Mul', 'ReduceMean']
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ort_lightning.export.onnx_nodes import NodeBuilder, graph_names

__all__ = ["CLASS_LOSSES", "build_loss"]

#: Losses whose label is a class index per position (int64), with the class axis 1 of the logits.
CLASS_LOSSES = ("cross_entropy", "nll")


class _Builder:
    """Appends named nodes and constants to one graph under a ``loss/<kind>/`` prefix."""

    def __init__(self, graph: onnx.GraphProto, kind: str) -> None:
        self.graph = graph
        self.prefix = f"loss/{kind}/"
        self._nodes = NodeBuilder(graph_names(graph))

    def name(self, hint: str) -> str:
        return self._nodes.name(f"{self.prefix}{hint}")

    def const(self, hint: str, value: Any, dtype: Any = np.float32) -> str:
        name = self.name(hint)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attributes: Any) -> str:
        node = self._nodes.node(op_type, inputs, name=f"{self.prefix}{op_type}", output=out, **attributes)
        self.graph.node.append(node)
        return node.output[0]

    def reduce(self, values: str, reduction: str, *, weights: str | None = None) -> str:
        """Sum or mean of `values` over every element (weighted mean: divided by the weights' sum)."""
        out = f"{self.prefix}out"
        if reduction == "sum":
            return self.op("ReduceSum", values, out=out, keepdims=0)
        if weights is None:
            return self.op("ReduceMean", values, out=out, keepdims=0)
        total = self.op("ReduceSum", values, keepdims=0)
        return self.op("Div", total, self.op("ReduceSum", weights, keepdims=0), out=out)


def _add_label(graph: onnx.GraphProto, output: str, label: str, *, class_index: bool) -> None:
    """Declare the label input: the output's shape, or without the class axis 1 for class indices."""
    if any(info.name == label for info in graph.input):
        return
    source = next(info for info in graph.output if info.name == output)
    info = copy.deepcopy(source)
    info.name = label
    if class_index:
        info.type.tensor_type.elem_type = TensorProto.INT64
        if len(info.type.tensor_type.shape.dim) >= 2:
            del info.type.tensor_type.shape.dim[1]
    graph.input.append(info)


def _class_weights(b: _Builder, label: str, options: dict[str, Any]) -> tuple[str, str, str, str | None]:
    """Return (valid mask, safe labels, per-position weights, class weights); ignored positions weigh 0."""
    valid = b.op("Cast", b.op("Not", b.op("Equal", label, b.const("ignore_index", options["ignore_index"], np.int64))),
                 to=TensorProto.FLOAT)
    safe = b.op("Where", b.op("Cast", valid, to=TensorProto.BOOL), label, b.const("zero", 0, np.int64))
    weights, class_weights = valid, None
    if options.get("weight") is not None:
        class_weights = b.const("weight", options["weight"])
        weights = b.op("Mul", valid, b.op("Gather", class_weights, safe))
    return valid, safe, weights, class_weights


def _picked(b: _Builder, log_probs: str, safe: str) -> str:
    """``log_probs[n, labels[n, ...], ...]``: the class axis 1 gathered away."""
    axis = b.const("axis1", [1], np.int64)
    index = b.op("Unsqueeze", safe, axis)
    return b.op("Squeeze", b.op("GatherElements", log_probs, index, axis=1), axis)


def _rank(graph: onnx.GraphProto, output: str) -> int:
    info = next(info for info in graph.output if info.name == output)
    return len(info.type.tensor_type.shape.dim)


def _nll(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    # NOTE: ORT 1.19.2 has no gradient for NegativeLogLikelihoodLoss; GatherElements has one.
    _, safe, weights, _ = _class_weights(b, label, options)
    losses = b.op("Mul", b.op("Neg", _picked(b, output, safe)), weights)
    return b.reduce(losses, options["reduction"], weights=weights)


def _softmax_cross_entropy(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    inputs = [output, label]
    if options.get("weight") is not None:
        inputs.append(b.const("weight", options["weight"]))
    # NOTE: ORT's gradient of this node reads its optional log_prob output: both are written.
    node = helper.make_node(
        "SoftmaxCrossEntropyLoss", inputs, [f"{b.prefix}out", b.name("log_prob")], name=b.name("SCE"),
        reduction=options["reduction"], ignore_index=int(options["ignore_index"]),
    )
    b.graph.node.append(node)
    return f"{b.prefix}out"


def _cross_entropy(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    smoothing = float(options.get("label_smoothing", 0.0))
    if smoothing == 0.0:
        return _softmax_cross_entropy(b, output, label, options)
    # torch: (1 - e) * w_y * -log p_y + e / C * sum_c w_c * -log p_c, over one denominator.
    log_probs = b.op("LogSoftmax", output, axis=1)
    valid, safe, weights, class_weights = _class_weights(b, label, options)
    nll = b.op("Mul", b.op("Neg", _picked(b, log_probs, safe)), weights)
    spread = b.op("Neg", log_probs)
    if class_weights is not None:
        # NOTE: (1, C, 1, ...) so that the weights broadcast over the class axis 1.
        shape = b.const("class_shape", [1, -1] + [1] * (_rank(b.graph, output) - 2), np.int64)
        spread = b.op("Mul", spread, b.op("Reshape", class_weights, shape))
    classes = len(options["weight"]) if class_weights is not None else None
    total = b.op("ReduceSum", spread, b.const("axes", [1], np.int64), keepdims=0)
    count = b.const("classes", float(classes)) if classes else b.op(
        "Cast", b.op("Gather", b.op("Shape", output), b.const("one", 1, np.int64)), to=TensorProto.FLOAT
    )
    smooth = b.op("Mul", b.op("Div", total, count), valid)
    kept = b.op("Mul", nll, b.const("keep", 1.0 - smoothing))
    mixed = b.op("Add", kept, b.op("Mul", smooth, b.const("e", smoothing)))
    return b.reduce(mixed, options["reduction"], weights=weights)


def _difference(b: _Builder, output: str, label: str) -> str:
    return b.op("Sub", output, label)


def _mse(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    difference = _difference(b, output, label)
    return b.reduce(b.op("Mul", difference, difference), options["reduction"])


def _l1(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    return b.reduce(b.op("Abs", _difference(b, output, label)), options["reduction"])


def _huber_terms(b: _Builder, output: str, label: str, delta: float) -> str:
    """``0.5 d^2`` where ``|d| < delta``, else ``delta * (|d| - 0.5 delta)``."""
    difference = _difference(b, output, label)
    magnitude = b.op("Abs", difference)
    quadratic = b.op("Mul", b.op("Mul", difference, difference), b.const("half", 0.5))
    linear = b.op("Mul", b.op("Sub", magnitude, b.const("half_delta", 0.5 * delta)), b.const("delta", delta))
    return b.op("Where", b.op("Less", magnitude, b.const("delta_cut", delta)), quadratic, linear)


def _huber(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    return b.reduce(_huber_terms(b, output, label, float(options["delta"])), options["reduction"])


def _smooth_l1(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    beta = float(options["beta"])
    if beta == 0.0:
        return _l1(b, output, label, options)
    # SmoothL1(beta) == Huber(delta=beta) / beta, as torch documents.
    terms = b.op("Div", _huber_terms(b, output, label, beta), b.const("beta", beta))
    return b.reduce(terms, options["reduction"])


def _bce_with_logits(b: _Builder, output: str, label: str, options: dict[str, Any]) -> str:
    # torch's stable form: (1 - y) x + (1 + (p - 1) y) softplus(-x), with
    # softplus(-x) = relu(-x) + log(1 + exp(-|x|)). NOTE: ORT 1.19.2 has no Softplus gradient.
    softplus = b.op(
        "Add",
        b.op("Relu", b.op("Neg", output)),
        b.op("Log", b.op("Add", b.const("one", 1.0), b.op("Exp", b.op("Neg", b.op("Abs", output))))),
    )
    one = b.const("one_", 1.0)
    if options.get("pos_weight") is not None:
        pos_weight = b.const("pos_weight", options["pos_weight"])
        scale = b.op("Add", one, b.op("Mul", b.op("Sub", pos_weight, one), label))
        softplus = b.op("Mul", softplus, scale)
    losses = b.op("Add", b.op("Mul", b.op("Sub", one, label), output), softplus)
    if options.get("weight") is not None:
        losses = b.op("Mul", losses, b.const("weight", options["weight"]))
    return b.reduce(losses, options["reduction"])


_BUILDERS: dict[str, Callable[[_Builder, str, str, dict[str, Any]], str]] = {
    "cross_entropy": _cross_entropy,
    "nll": _nll,
    "mse": _mse,
    "l1": _l1,
    "bce_with_logits": _bce_with_logits,
    "smooth_l1": _smooth_l1,
    "huber": _huber,
}


def build_loss(graph: onnx.GraphProto, kind: str, options: dict[str, Any], *, output: str, label: str) -> str:
    """Append loss `kind` over graph output `output` and label input `label`; return the loss's name.

    Args:
        graph: the forward graph, changed in place.
        kind: a key of the builders (``"cross_entropy"``, ``"nll"``, ``"mse"``, ``"l1"``,
            ``"bce_with_logits"``, ``"smooth_l1"``, ``"huber"``).
        options: ``reduction`` and the loss's own options, as `ort_lightning.export.losses.spec` records them.
        output: the model output the loss reads (logits, log-probabilities or predictions).
        label: the label input's name; declared as an input unless the graph has it already.
    """
    _add_label(graph, output, label, class_index=kind in CLASS_LOSSES)
    return _BUILDERS[kind](_Builder(graph, kind), output, label, options)
