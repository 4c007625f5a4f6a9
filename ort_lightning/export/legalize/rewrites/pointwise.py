"""Pointwise and reduction rewrites behind `_legalize.RULES`: exact equivalents in ops ORT can differentiate.

Every function takes the `Graph` and one node, emits the nodes that replace it (``graph.emit``)
and returns them, or returns None when this node needs no change. New nodes are named under the
old node's name, so that an error about them still names the torch module they came from.
"""

from __future__ import annotations

import numpy as np
import onnx

from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import Graph, attr, where

__all__ = [
    "celu", "control_flow", "elu", "hard_sigmoid", "hard_swish", "instance_norm", "layer_norm_outputs", "prelu",
    "reduce_l2", "reduce_max", "reduce_min", "relu", "same_type_cast", "selu", "sign", "softplus",
]

_F32 = np.float32


def layer_norm_outputs(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """Give LayerNormalization its optional Mean and InvStdDev outputs (the op itself is unchanged)."""
    if len(node.output) >= 3 and all(node.output):
        return Declined("its Mean and InvStdDev outputs are already there")
    outputs = list(node.output) + [""] * (3 - len(node.output))
    for index, role in ((1, "mean"), (2, "inv_std_dev")):
        if not outputs[index]:
            outputs[index] = graph.name(f"{node.name or 'LayerNormalization'}/{role}")
    del node.output[:]
    node.output.extend(outputs)
    return [node]


def _clip01(graph: Graph, node: onnx.NodeProto, x: str, alpha: float, beta: float, output: str | None = None) -> str:
    """``Clip(alpha * x + beta, 0, 1)``: HardSigmoid in ops with gradients."""
    shifted = graph.emit("Add", [graph.emit("Mul", [x, graph.const(np.array(alpha, _F32), node)], node),
                                 graph.const(np.array(beta, _F32), node)], node)
    low, high = graph.const(np.array(0.0, _F32), node), graph.const(np.array(1.0, _F32), node)
    return graph.emit("Clip", [shifted, low, high], node, output=output)


def hard_sigmoid(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``HardSigmoid(x) = Clip(alpha * x + beta, 0, 1)``."""
    _clip01(graph, node, node.input[0], float(attr(node, "alpha", 0.2)), float(attr(node, "beta", 0.5)), node.output[0])
    return graph.take()


def hard_swish(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``HardSwish(x) = x * Clip(x / 6 + 1/2, 0, 1)``."""
    gate = _clip01(graph, node, node.input[0], 1.0 / 6.0, 0.5)
    graph.emit("Mul", [node.input[0], gate], node, output=node.output[0])
    return graph.take()


def _relu_parts(graph: Graph, node: onnx.NodeProto, x: str) -> tuple[str, str]:
    """``(max(x, 0), min(x, 0))`` as ``x * (x > 0)`` and ``x - that``: vectorized Mul/Sub gradients (see `relu`).

    ELU, SELU, CELU and PReLU are built on it (1.53x -> 1.20x a ReLU CNN's step for ELU, against a
    Relu and a one-sided Clip); as for `relu`, an input of -inf gives NaN.
    """
    positive = _masked_relu(graph, node, x)
    return positive, graph.emit("Sub", [x, positive], node)


def _masked_relu(graph: Graph, node: onnx.NodeProto, x: str, output: str | None = None) -> str:
    """``x * (x > 0)``; the comparison carries no gradient."""
    zero = graph.const(np.array(0, dtype=_F32), node)
    mask = graph.emit("Cast", [graph.emit("Greater", [x, zero], node)], node, to=onnx.TensorProto.FLOAT)
    return graph.emit("Mul", [x, mask], node, output=output)


def _exp_minus_one(graph: Graph, node: onnx.NodeProto, x: str, alpha: float) -> str:
    """``alpha * (exp(x / alpha) - 1)``."""
    scaled = graph.emit("Mul", [x, graph.const(np.array(1.0 / alpha, _F32), node)], node) if alpha != 1.0 else x
    shifted = graph.emit("Sub", [graph.emit("Exp", [scaled], node), graph.const(np.array(1.0, _F32), node)], node)
    return graph.emit("Mul", [shifted, graph.const(np.array(alpha, _F32), node)], node)


def _elu(graph: Graph, node: onnx.NodeProto, alpha: float, scale: float, *, inner: float = 1.0) -> list[onnx.NodeProto]:
    # NOTE: exp(min(x, 0)) rather than Where(x > 0, x, exp(x) - 1): the unused branch of a Where
    # overflows for large x and its zero gradient times inf is NaN.
    positive, negative = _relu_parts(graph, node, node.input[0])
    tail = _exp_minus_one(graph, node, negative, inner)
    if inner == 1.0 and alpha != 1.0:
        tail = graph.emit("Mul", [tail, graph.const(np.array(alpha, _F32), node)], node)
    total = graph.emit("Add", [positive, tail], node, output=None if scale != 1.0 else node.output[0])
    if scale != 1.0:
        graph.emit("Mul", [total, graph.const(np.array(scale, _F32), node)], node, output=node.output[0])
    return graph.take()


def elu(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Elu(x) = max(x, 0) + alpha * (exp(min(x, 0)) - 1)``."""
    return _elu(graph, node, float(attr(node, "alpha", 1.0)), 1.0)


def selu(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Selu(x) = gamma * Elu_alpha(x)``."""
    alpha = float(attr(node, "alpha", 1.67326319217681884765625))
    gamma = float(attr(node, "gamma", 1.05070102214813232421875))
    return _elu(graph, node, alpha, gamma)


def celu(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Celu(x) = max(x, 0) + alpha * (exp(min(x, 0) / alpha) - 1)``."""
    return _elu(graph, node, 1.0, 1.0, inner=float(attr(node, "alpha", 1.0)))


def softplus(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Softplus(x) = x if x > 20 else log(1 + exp(x))``, torch's own threshold (exp never overflows)."""
    # NOTE: the exp branch sees min(x, 20), so the unused branch of the Where stays finite and its
    # zero gradient cannot turn into NaN.
    limit = graph.const(np.array(20.0, _F32), node)
    exp = graph.emit("Exp", [graph.emit("Clip", [node.input[0], "", limit], node)], node)
    log = graph.emit("Log", [graph.emit("Add", [exp, graph.const(np.array(1.0, _F32), node)], node)], node)
    above = graph.emit("Greater", [node.input[0], limit], node)
    graph.emit("Where", [above, node.input[0], log], node, output=node.output[0])
    return graph.take()


def prelu(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``PRelu(x, slope) = max(x, 0) + slope * min(x, 0)`` (slope broadcast as PRelu does)."""
    positive, negative = _relu_parts(graph, node, node.input[0])
    graph.emit("Add", [positive, graph.emit("Mul", [negative, node.input[1]], node)], node, output=node.output[0])
    return graph.take()


def relu(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Relu(x) = x * (x > 0)``: the gradient becomes one Mul by the mask.

    ORT 1.19.2's CPU ReluGrad runs on one thread, element by element (a fifth of a ResNet step);
    Mul runs vectorized on every intra-op thread. The only value that differs is ``x = -inf``
    (``-inf * 0`` is NaN; torch gives 0).
    """
    _masked_relu(graph, node, node.input[0], node.output[0])
    return graph.take()


def sign(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``Sign(x) = (x > 0) - (x < 0)``: comparisons carry no gradient, as Sign's is zero."""
    zero = graph.const(np.array(0, dtype=_F32), node)
    above = graph.emit("Cast", [graph.emit("Greater", [node.input[0], zero], node)], node, to=onnx.TensorProto.FLOAT)
    below = graph.emit("Cast", [graph.emit("Less", [node.input[0], zero], node)], node, to=onnx.TensorProto.FLOAT)
    graph.emit("Sub", [above, below], node, output=node.output[0])
    return graph.take()


def same_type_cast(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """A Cast to the type its input already has is the identity: it becomes ``Identity``.

    peft's LoRA layer ends with ``result.to(previous_dtype)`` and Gemma's RMSNorm with
    ``output.type_as(x)``: float32 to float32. ORT's cast propagation removes such a Cast before the
    gradient graph is built, and fails ("Argument mismatch when removing edge", graph.cc:1591) when
    the Cast's output feeds one node at two inputs (``x * x`` in Gemma's tanh GELU).
    """
    source = graph.elem_type(node.input[0])
    if source is None:
        return Declined("its input's type is unknown")
    if source != attr(node, "to", None):
        return Declined("it changes the type")
    graph.emit("Identity", [node.input[0]], node, output=node.output[0])
    return graph.take()


def _reduce(graph: Graph, node: onnx.NodeProto, op: str, x: str) -> str:
    """`op` (ReduceMax, ReduceSum) over the axes of `node`, keepdims as `node`, in the graph opset's spelling."""
    keepdims = int(attr(node, "keepdims", 1))
    axes = attr(node, "axes", None)
    axes_input = node.input[1] if len(node.input) > 1 else ""
    # NOTE: axes became an input in opset 13 for ReduceSum and in opset 18 for the other reductions.
    if graph.opset >= (13 if op == "ReduceSum" else 18):
        if axes is not None:
            axes_input = graph.const(np.array(axes, np.int64), node)
        return graph.emit(op, [x, axes_input] if axes_input else [x], node, keepdims=keepdims)
    if axes is None and axes_input:
        value = graph.value(axes_input)
        axes = None if value is None else [int(a) for a in value.reshape(-1)]
    return graph.emit(op, [x], node, keepdims=keepdims, **({} if axes is None else {"axes": axes}))


def _top_one(graph: Graph, node: onnx.NodeProto, *, largest: int) -> Replacement:
    """ReduceMax/ReduceMin over one axis (or all) as TopK(k=1), whose gradient ORT has."""
    axes = attr(node, "axes", None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = graph.value(node.input[1])
        axes = None if value is None else [int(a) for a in value.reshape(-1)]
    keepdims, shape, x = int(attr(node, "keepdims", 1)), graph.shape(node.input[0]), node.input[0]
    if shape is None:
        return Declined("the input's rank is unknown at export")
    if axes is not None and len(axes) != 1:
        return Declined(f"reduces over {len(axes)} axes; TopK takes one")
    one = graph.const(np.array([1], np.int64), node)
    if axes is None:  # every axis: the top of the flattened tensor, then the reduced shape
        flat = graph.emit("Reshape", [x, graph.const(np.array([-1], np.int64), node)], node)
        top = graph.node("TopK", [flat, one], node, axis=0, largest=largest)
        top.output.append(graph.name(f"{node.name}/indices"))
        graph.emitted.append(top)
        reduced = np.ones(len(shape), np.int64) if keepdims else np.zeros(0, np.int64)
        graph.emit("Reshape", [top.output[0], graph.const(reduced, node)], node, output=node.output[0])
        return graph.take()
    axis = int(axes[0]) % len(shape)
    top = graph.node("TopK", [x, one], node, output=node.output[0] if keepdims else None, axis=axis, largest=largest)
    top.output.append(graph.name(f"{node.name}/indices"))
    graph.emitted.append(top)
    if not keepdims:
        graph.emit("Squeeze", [top.output[0], graph.const(np.array([axis], np.int64), node)], node,
                   output=node.output[0])
    return graph.take()


def reduce_max(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """``ReduceMax(x)`` over one axis or all axes as ``TopK(x, 1)``."""
    return _top_one(graph, node, largest=1)


def reduce_min(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """``ReduceMin(x)`` over one axis or all axes as ``TopK(x, 1, largest=0)``."""
    return _top_one(graph, node, largest=0)


def control_flow(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """Refuse If/Loop/Scan with a floating-point output: ORT 1.19.2's gradient builder aborts the process on them.

    Raises:
        ExportError: naming the node and the torch module.
    """
    if not any(graph.is_float(output) for output in node.output):
        return Declined("no floating-point output: off the gradient path")
    raise ExportError(
        f"{where(node)} is control flow on the gradient path, and ORT 1.19.2's gradient builder aborts the "
        "process on it (it cannot be rewritten, as its branches depend on the data); write that layer without "
        "data-dependent Python control flow (e.g. nn.LocalResponseNorm on 4-d input exports an If), or freeze it "
        "and everything before it."
    )


def reduce_l2(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``ReduceL2(x) = sqrt(ReduceSum(x * x))`` (ORT 1.19.2's ReduceL2 gradient graph is invalid)."""
    squares = graph.emit("Mul", [node.input[0], node.input[0]], node)
    graph.emit("Sqrt", [_reduce(graph, node, "ReduceSum", squares)], node, output=node.output[0])
    return graph.take()


def _reduce_mean_axis2(graph: Graph, node: onnx.NodeProto, x: str) -> str:
    """ReduceMean over axis 2, keeping it, in the spelling of the graph's opset (axes became an input in 18)."""
    if graph.opset >= 18:
        return graph.emit("ReduceMean", [x, graph.const(np.array([2], np.int64), node)], node, keepdims=1)
    return graph.emit("ReduceMean", [x], node, axes=[2], keepdims=1)


def instance_norm(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """InstanceNormalization as ``(x - mean) / sqrt(var + eps) * scale + bias`` over a (N, C, -1) view."""
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    shape = graph.emit("Shape", [x], node)
    flat = graph.emit("Reshape", [x, graph.const(np.array([0, 0, -1], np.int64), node)], node)
    centered = graph.emit("Sub", [flat, _reduce_mean_axis2(graph, node, flat)], node)
    variance = _reduce_mean_axis2(graph, node, graph.emit("Mul", [centered, centered], node))
    epsilon = graph.const(np.array(float(attr(node, "epsilon", 1e-5)), _F32), node)
    std = graph.emit("Sqrt", [graph.emit("Add", [variance, epsilon], node)], node)
    normed = graph.emit("Div", [centered, std], node)
    column = graph.const(np.array([-1, 1], np.int64), node)
    scaled = graph.emit("Mul", [normed, graph.emit("Reshape", [scale, column], node)], node)
    moved = graph.emit("Add", [scaled, graph.emit("Reshape", [bias, column], node)], node)
    graph.emit("Reshape", [moved, shape], node, output=node.output[0])
    return graph.take()
