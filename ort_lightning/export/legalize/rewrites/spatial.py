"""Shape-aware rewrites behind `_legalize.RULES`: pooling, resizing, reversed slices, depth-to-space, cumsum.

These need static sizes along the axes they work on (the batch may stay dynamic); they read them
from ONNX shape inference. A node whose sizes are unknown is left as it is, or refused with an
`ExportError` when leaving it would crash ORT.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import Graph, attr
from ort_lightning.export.legalize.rewrites.gather import take

__all__ = ["along_axis", "average_pool", "cumsum", "depth_to_space", "resize", "reversed_slice"]

_I64 = np.int64
_END = np.iinfo(np.int64).max


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
        divisors[o] = stop - start if include_pad else min(stop, size) - max(start, 0)
    return divisors, max(0, (out - 1) * stride + kernel - (size + begin + end))


def _pool_scale(node: onnx.NodeProto, spatial: list[int] | None, kernel: list[int]) -> tuple[np.ndarray, list[int]]:
    """1 / divisor per output position (or one scalar) and the Conv pads that give torch's output size."""
    rank = len(kernel)
    strides = [int(s) for s in attr(node, "strides", [1] * rank)]
    pads = [int(p) for p in attr(node, "pads", [0] * (2 * rank))]
    ceil_mode, include_pad = bool(attr(node, "ceil_mode", 0)), bool(attr(node, "count_include_pad", 0))
    if spatial is None:
        # Only a uniform divisor (every window counts kernel elements) works without the sizes.
        if ceil_mode or (any(pads) and not include_pad):
            raise ValueError("ceil_mode or padding that is not counted needs static spatial sizes")
        return np.array(1.0 / math.prod(kernel), np.float32), pads
    divisor, conv_pads = np.ones((), np.float64), list(pads)
    for axis in range(rank):
        divisors, extra = _pool_geometry(spatial[axis], kernel[axis], strides[axis], pads[axis], pads[axis + rank],
                                         ceil_mode=ceil_mode, include_pad=include_pad)
        divisor = np.multiply.outer(divisor, divisors)
        conv_pads[axis + rank] += extra
    return (1.0 / divisor).astype(np.float32), conv_pads


def _dims(graph: Graph, node: onnx.NodeProto, shape: str, start: int, end: int) -> str:
    """``shape[start:end]`` of a Shape output."""
    bounds = [graph.const(np.array([bound], _I64), node) for bound in (start, end)]
    return graph.emit("Slice", [shape, *bounds], node)


def average_pool(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """AveragePool over a dynamic batch as a one-channel Conv with a ones kernel over a (N*C, 1, ...) view.

    The divisor per output position comes from the static spatial sizes, so ``count_include_pad`` and
    ``ceil_mode`` give exactly what torch gives; a static batch keeps the native op (it works there).

    Raises:
        ExportError: when the rewrite cannot be exact (dilations, auto_pad, or unknown spatial sizes
            with ceil_mode or uncounted padding).
    """
    shape = graph.shape(node.input[0])
    if shape is not None and isinstance(shape[0], int) and shape[0] > 0:
        return Declined(f"static batch {shape[0]}: ORT's gradient works there")
    kernel = [int(k) for k in attr(node, "kernel_shape", [])]
    known = shape is not None and len(shape) == len(kernel) + 2 and all(isinstance(d, int) for d in shape[2:])
    spatial = [int(d) for d in shape[2:]] if known and shape is not None else None  # type: ignore[arg-type]
    try:
        if any(int(d) != 1 for d in attr(node, "dilations", [])) or attr(node, "auto_pad", b"NOTSET") not in (
            b"NOTSET", b"VALID", "NOTSET", "VALID"
        ):
            raise ValueError("dilations and auto_pad are not rewritten")
        scale, pads = _pool_scale(node, spatial, kernel)
    except ValueError as reason:
        raise ExportError(
            f"AveragePool node {node.name!r} runs over a dynamic batch, where ORT 1.19.2's gradient kills the "
            f"process (SIGFPE), and it cannot be rewritten exactly ({reason}; input shape {shape}); export with "
            "a fixed batch size, or use AvgPool without ceil_mode/dilation on inputs of fixed spatial size."
        ) from None
    full = graph.emit("Shape", [node.input[0]], node)
    rest = _dims(graph, node, full, 2, _END)
    flat_shape = graph.emit("Concat", [graph.const(np.array([-1, 1], _I64), node), rest], node, axis=0)
    flat = graph.emit("Reshape", [node.input[0], flat_shape], node)
    weight = graph.const(np.ones((1, 1, *kernel), np.float32), node)
    strides = [int(s) for s in attr(node, "strides", [1] * len(kernel))]
    summed = graph.emit("Conv", [flat, weight], node, kernel_shape=kernel, strides=strides, pads=pads)
    averaged = graph.emit("Mul", [summed, graph.const(scale, node)], node)
    tail = _dims(graph, node, graph.emit("Shape", [averaged], node), 2, _END)
    out_shape = graph.emit("Concat", [_dims(graph, node, full, 0, 2), tail], node, axis=0)
    graph.emit("Reshape", [averaged, out_shape], node, output=node.output[0])
    return graph.take()


def reversed_slice(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """A Slice with a negative step (``torch.flip``, ``x[::-1]``) as gathers of constant indices (`take`).

    ORT 1.19.2's SliceGrad fails on negative steps (``narrowing_error`` at the first step).
    """
    steps = graph.value(node.input[4]) if len(node.input) > 4 else None
    if steps is None or not (steps < 0).any():
        return Declined("no negative step known at export: SliceGrad takes it")
    starts, ends, axes = (graph.value(name) if name else None for name in [*node.input[1:4], ""][:3])
    shape = graph.shape(node.input[0])
    if starts is None or ends is None or shape is None:
        return Declined("its starts, ends or input shape are not known at export")
    axes = np.arange(len(starts)) if axes is None else axes
    rank = len(shape)
    sizes = [shape[int(axis) % rank] for axis in axes]
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        return Declined(f"the sliced axes have sizes {sizes}, not all fixed at export")
    current = node.input[0]
    for position, (start, end, axis, step) in enumerate(zip(starts, ends, axes, steps, strict=True)):
        index = np.arange(int(sizes[position] or 0))[slice(int(start), int(end), int(step))].astype(_I64)
        last = position == len(starts) - 1
        current = take(graph, node, current, index, int(axis) % rank, rank, node.output[0] if last else None)
    return graph.take()


def depth_to_space(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """DepthToSpace (``nn.PixelShuffle``) as Reshape -> Transpose -> Reshape, in either mode."""
    shape = graph.shape(node.input[0])
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
        return Declined(f"input shape {shape}: needs 4 dimensions, all but the batch fixed at export")
    channels, height, width = (int(d or 0) for d in shape[1:])
    block = int(attr(node, "blocksize", 1))
    depth = channels // (block * block)
    if attr(node, "mode", b"DCR") in (b"CRD", "CRD"):
        split, perm = [0, depth, block, block, height, width], [0, 1, 4, 2, 5, 3]
    else:
        split, perm = [0, block, block, depth, height, width], [0, 3, 4, 1, 5, 2]
    merged = [0, depth, height * block, width * block]
    blocks = graph.emit("Reshape", [node.input[0], graph.const(np.array(split, _I64), node)], node)
    moved = graph.emit("Transpose", [blocks], node, perm=perm)
    graph.emit("Reshape", [moved, graph.const(np.array(merged, _I64), node)], node, output=node.output[0])
    return graph.take()


def cumsum(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """CumSum along an axis of static length as a MatMul with a triangular matrix of ones."""
    axis_value, shape = graph.value(node.input[1]), graph.shape(node.input[0])
    if not graph.is_float(node.input[0]):
        # NOTE: an integer CumSum (transformers' packed-sequence ids) has no gradient to build, and a
        # float32 ones matrix would not multiply it.
        return Declined("it sums integers, which need no gradient")
    if axis_value is None or shape is None:
        return Declined("its axis or input shape is not known at export")
    rank = len(shape)
    axis = int(axis_value.reshape(-1)[0]) % rank
    length = shape[axis]
    if not isinstance(length, int) or length <= 0:
        return Declined(f"the summed axis has size {length!r}, not fixed at export")
    exclusive, reverse = bool(attr(node, "exclusive", 0)), bool(attr(node, "reverse", 0))
    rows, cols = np.indices((length, length))
    picks = (rows >= cols if reverse else rows <= cols) & ((rows != cols) if exclusive else True)
    matrix = graph.const(picks.astype(np.float32), node)
    if axis == rank - 1:
        graph.emit("MatMul", [node.input[0], matrix], node, output=node.output[0])
        return graph.take()
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = graph.emit("Transpose", [node.input[0]], node, perm=perm)
    summed = graph.emit("MatMul", [moved, matrix], node)
    graph.emit("Transpose", [summed], node, output=node.output[0], perm=perm)
    return graph.take()


def _resize_matrix(node: onnx.NodeProto, size_in: int, size_out: int, scale: float | None) -> np.ndarray:
    """The (size_out, size_in) matrix that `node`'s Resize applies along one axis, read off an identity."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name not in ("axes",)}
    one = helper.make_node("Resize", ["x", "", "scales" if scale else "", "" if scale else "sizes"], ["y"],
                           **attributes)
    graph = helper.make_graph([one], "resize", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    feeds = {"x": np.eye(size_in, dtype=np.float32)}
    if scale:
        feeds["scales"] = np.array([1.0, scale], np.float32)
    else:
        feeds["sizes"] = np.array([size_in, size_out], _I64)
    (result,) = ReferenceEvaluator(model).run(None, feeds)
    return np.asarray(result, np.float32).T


def resize(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """Resize (``nn.Upsample``, ``F.interpolate``) as one MatMul per resized axis with its interpolation matrix.

    ORT 1.19.2 has no CPU kernel for ResizeGrad. Every mode ONNX defines is linear in the input and
    separable by axis, so the matrix of each axis is read off the op itself applied to an identity.
    """
    source, target = graph.shape(node.input[0]), graph.shape(node.output[0])
    if source is None or target is None or len(source) != len(target) or len(source) < 3:
        return Declined(f"input shape {source} and output shape {target}: needs both, of one rank of 3 or more")
    scales_value = graph.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    current, rank = node.input[0], len(source)
    axes = [a for a in range(2, rank) if source[a] != target[a]]
    if not all(isinstance(source[a], int) and isinstance(target[a], int) for a in axes) or not axes:
        return Declined(f"resizes from {source} to {target}: no resized axis, or one not fixed at export")
    for count, axis in enumerate(axes):
        scale = float(scales_value[axis]) if scales_value is not None and scales_value.size else None
        matrix = _resize_matrix(node, int(source[axis]), int(target[axis]), scale)  # type: ignore[arg-type]
        output = node.output[0] if count == len(axes) - 1 else None
        current = along_axis(graph, node, current, matrix, axis, rank, output)
    return graph.take()


def along_axis(graph: Graph, node: onnx.NodeProto, x: str, matrix: np.ndarray, axis: int, rank: int,
                output: str | None) -> str:
    """Apply `matrix` (out x in) along `axis` of `x`: right-multiply the last axis, left-multiply the others."""
    if axis == rank - 1:
        return graph.emit("MatMul", [x, graph.const(np.ascontiguousarray(matrix.T), node)], node, output=output)
    if axis == rank - 2:
        return graph.emit("MatMul", [graph.const(matrix, node), x], node, output=output)
    perm = list(range(rank))
    perm[axis], perm[rank - 2] = perm[rank - 2], perm[axis]
    moved = graph.emit("Transpose", [x], node, perm=perm)
    mixed = graph.emit("MatMul", [graph.const(matrix, node), moved], node)
    return graph.emit("Transpose", [mixed], node, output=output, perm=perm)
