"""The rewrites behind `_legalize.RULES`: each turns one node into exact equivalents ORT can differentiate.

Every function takes the `Graph` (names, opset, shapes) and one node, and returns the nodes that
replace it, or None when this node needs no change. New nodes are named under the old node's
name, so that an error about them still names the torch module they came from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ort_lightning.errors import ExportError

__all__ = ["Graph", "average_pool", "hard_sigmoid", "hard_swish", "instance_norm", "layer_norm_outputs"]


class Graph:
    """What the rewrites need to know about the graph: unique names, its opset, static shapes."""

    def __init__(self, proto: onnx.ModelProto) -> None:
        self.proto = proto
        self.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
        self._taken = {name for node in proto.graph.node for name in (*node.input, *node.output)}
        self._taken |= {t.name for t in proto.graph.initializer} | {n.name for n in proto.graph.node}
        self._shapes: dict[str, list[int | str | None]] | None = None

    def name(self, base: str) -> str:
        """A value or node name not yet used in the graph, derived from `base`."""
        name, suffix = base, 0
        while name in self._taken:
            suffix += 1
            name = f"{base}_{suffix}"
        self._taken.add(name)
        return name

    def shape(self, value: str) -> list[int | str | None] | None:
        """Dimensions of `value` (ints, symbolic names, None if unknown), from ONNX shape inference."""
        if self._shapes is None:
            self._shapes = _infer_shapes(self.proto)
        return self._shapes.get(value)

    def node(
        self, op: str, inputs: list[str], like: onnx.NodeProto, output: str | None = None, **attrs: Any
    ) -> onnx.NodeProto:
        """A new node named under `like` (so its scope survives), with a fresh output unless given."""
        out = output or self.name(f"{like.name or like.op_type}/{op}_out")
        return helper.make_node(op, inputs, [out], name=self.name(f"{like.name or like.op_type}/{op}"), **attrs)

    def constant(self, array: np.ndarray, like: onnx.NodeProto) -> onnx.NodeProto:
        """A Constant node (not an initializer: it must never become a parameter)."""
        out = self.name(f"{like.name or like.op_type}/const")
        return helper.make_node(
            "Constant", [], [out], name=self.name(f"{like.name or like.op_type}/Constant"),
            value=numpy_helper.from_array(array, out),
        )


def _infer_shapes(proto: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # onnx raises several types for a graph it cannot infer; shapes stay unknown
        inferred = proto
    shapes: dict[str, list[int | str | None]] = {}
    graph = inferred.graph
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if not info.type.tensor_type.HasField("shape"):
            continue
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
    return shapes


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def layer_norm_outputs(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """Give LayerNormalization its optional Mean and InvStdDev outputs (the op itself is unchanged)."""
    if len(node.output) >= 3 and all(node.output):
        return None
    outputs = list(node.output) + [""] * (3 - len(node.output))
    for index, role in ((1, "mean"), (2, "inv_std_dev")):
        if not outputs[index]:
            outputs[index] = graph.name(f"{node.name or 'LayerNormalization'}/{role}")
    del node.output[:]
    node.output.extend(outputs)
    return [node]


def _clip01(graph: Graph, node: onnx.NodeProto, x: str, alpha: float, beta: float, output: str) -> list[onnx.NodeProto]:
    """``Clip(alpha * x + beta, 0, 1)``: HardSigmoid in ops with gradients."""
    f32 = np.float32
    a, b = graph.constant(np.array(alpha, f32), node), graph.constant(np.array(beta, f32), node)
    lo, hi = graph.constant(np.array(0.0, f32), node), graph.constant(np.array(1.0, f32), node)
    scaled = graph.node("Mul", [x, a.output[0]], node)
    shifted = graph.node("Add", [scaled.output[0], b.output[0]], node)
    clipped = graph.node("Clip", [shifted.output[0], lo.output[0], hi.output[0]], node, output=output)
    return [a, b, lo, hi, scaled, shifted, clipped]


def hard_sigmoid(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``HardSigmoid(x) = Clip(alpha * x + beta, 0, 1)``."""
    alpha, beta = float(_attr(node, "alpha", 0.2)), float(_attr(node, "beta", 0.5))
    return _clip01(graph, node, node.input[0], alpha, beta, node.output[0])


def hard_swish(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``HardSwish(x) = x * Clip(x / 6 + 1/2, 0, 1)``."""
    gate = graph.name(f"{node.name or 'HardSwish'}/gate")
    nodes = _clip01(graph, node, node.input[0], 1.0 / 6.0, 0.5, gate)
    return [*nodes, graph.node("Mul", [node.input[0], gate], node, output=node.output[0])]


def _reduce_mean(graph: Graph, node: onnx.NodeProto, x: str) -> list[onnx.NodeProto]:
    """ReduceMean over axis 2, keeping it, in the spelling of the graph's opset (axes moved to an input in 18)."""
    if graph.opset >= 18:
        axes = graph.constant(np.array([2], np.int64), node)
        return [axes, graph.node("ReduceMean", [x, axes.output[0]], node, keepdims=1)]
    return [graph.node("ReduceMean", [x], node, axes=[2], keepdims=1)]


def instance_norm(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """InstanceNormalization as ``(x - mean) / sqrt(var + eps) * scale + bias`` over a (N, C, -1) view."""
    x, scale, bias = node.input[0], node.input[1], node.input[2]
    eps = float(_attr(node, "epsilon", 1e-5))
    shape = graph.node("Shape", [x], node)
    flat_shape = graph.constant(np.array([0, 0, -1], np.int64), node)
    column = graph.constant(np.array([-1, 1], np.int64), node)
    epsilon = graph.constant(np.array(eps, np.float32), node)
    flat = graph.node("Reshape", [x, flat_shape.output[0]], node)
    mean = _reduce_mean(graph, node, flat.output[0])
    centered = graph.node("Sub", [flat.output[0], mean[-1].output[0]], node)
    squared = graph.node("Mul", [centered.output[0], centered.output[0]], node)
    variance = _reduce_mean(graph, node, squared.output[0])
    shifted = graph.node("Add", [variance[-1].output[0], epsilon.output[0]], node)
    std = graph.node("Sqrt", [shifted.output[0]], node)
    normed = graph.node("Div", [centered.output[0], std.output[0]], node)
    scale_col = graph.node("Reshape", [scale, column.output[0]], node)
    bias_col = graph.node("Reshape", [bias, column.output[0]], node)
    scaled = graph.node("Mul", [normed.output[0], scale_col.output[0]], node)
    moved = graph.node("Add", [scaled.output[0], bias_col.output[0]], node)
    result = graph.node("Reshape", [moved.output[0], shape.output[0]], node, output=node.output[0])
    return [
        shape, flat_shape, column, epsilon, flat, *mean, centered, squared, *variance, shifted, std, normed,
        scale_col, bias_col, scaled, moved, result,
    ]


def _pool_geometry(
    size: int, kernel: int, stride: int, begin: int, end: int, *, ceil_mode: bool, include_pad: bool
) -> tuple[np.ndarray, int]:
    """Per output position along one axis: the divisor torch uses; and the extra end padding ceil_mode needs."""
    span = size + begin + end - kernel
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + begin:
        # NOTE: torch (and ONNX) drop a last window that would start in the end padding.
        out -= 1
    divisors = np.empty(out, np.float64)
    for o in range(out):
        start = o * stride - begin
        stop = min(start + kernel, size + end)
        counted = stop - start if include_pad else min(stop, size) - max(start, 0)
        divisors[o] = counted
    extra = max(0, (out - 1) * stride + kernel - (size + begin + end))
    return divisors, extra


def average_pool(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """AveragePool over a dynamic batch as a depthwise Conv with a ones kernel, times 1/divisor per position.

    The divisor map is computed here from the static channel and spatial sizes, so that
    ``count_include_pad`` and ``ceil_mode`` give exactly what torch gives. A static batch keeps
    the native op (its gradient works there).

    Raises:
        ExportError: for a dynamic batch with unknown channel or spatial sizes, or dilations/auto_pad.
    """
    shape = graph.shape(node.input[0])
    if shape is not None and isinstance(shape[0], int) and shape[0] > 0:
        return None
    kernel = [int(k) for k in _attr(node, "kernel_shape", [])]
    rank = len(kernel)
    static = shape is not None and all(isinstance(d, int) and d > 0 for d in shape[1:]) and len(shape) == rank + 2
    dilations = [int(d) for d in _attr(node, "dilations", [1] * rank)]
    auto_pad = _attr(node, "auto_pad", b"NOTSET")
    if not static or any(d != 1 for d in dilations) or auto_pad not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        raise ExportError(
            f"AveragePool node {node.name!r} runs over a dynamic batch, which kills ORT 1.19.2's gradient "
            f"(SIGFPE), and it cannot be rewritten (input shape {shape}, dilations {dilations}, auto_pad "
            f"{auto_pad!r}; the rewrite needs static channel and spatial sizes); export with a fixed batch "
            "size, or give the model fixed spatial sizes."
        )
    dims = [d for d in (shape or [])[1:] if isinstance(d, int)]
    return _pool_as_conv(graph, node, dims, kernel)


def _pool_as_conv(graph: Graph, node: onnx.NodeProto, dims: list[int], kernel: list[int]) -> list[onnx.NodeProto]:
    channels, spatial, rank = dims[0], dims[1:], len(kernel)
    strides = [int(s) for s in _attr(node, "strides", [1] * rank)]
    pads = [int(p) for p in _attr(node, "pads", [0] * (2 * rank))]
    ceil_mode, include_pad = bool(_attr(node, "ceil_mode", 0)), bool(_attr(node, "count_include_pad", 0))
    divisor = np.ones((), np.float64)
    conv_pads = list(pads)
    for axis in range(rank):
        divisors, extra = _pool_geometry(
            spatial[axis], kernel[axis], strides[axis], pads[axis], pads[axis + rank],
            ceil_mode=ceil_mode, include_pad=include_pad,
        )
        divisor = np.multiply.outer(divisor, divisors)
        conv_pads[axis + rank] += extra
    weight = graph.constant(np.ones((channels, 1, *kernel), np.float32), node)
    scale = graph.constant((1.0 / divisor).astype(np.float32)[None, None], node)
    conv = graph.node(
        "Conv", [node.input[0], weight.output[0]], node, group=channels, kernel_shape=kernel, strides=strides,
        pads=conv_pads,
    )
    return [weight, scale, conv, graph.node("Mul", [conv.output[0], scale.output[0]], node, output=node.output[0])]
