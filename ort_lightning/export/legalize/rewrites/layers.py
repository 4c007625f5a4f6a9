"""Layer rewrites behind `_legalize.RULES`: padding modes, transposed convolution, bidirectional RNNs, einsum.

Like the other rewrites they are exact, need static sizes along the axes they touch (the batch
may stay dynamic), and leave a node they cannot rewrite for ORT, or refuse it with an
`ExportError` when ORT would fail on it only later (when the artifacts are loaded).
"""

from __future__ import annotations

import numpy as np
import onnx

from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import Graph, attr, where
from ort_lightning.export.legalize.rewrites.gather import take
from ort_lightning.export.legalize.rewrites.spatial import along_axis

__all__ = ["bidirectional_rnn", "conv_transpose", "einsum", "pad"]

_I64 = np.int64
_NUMPY_PAD_MODES = {"reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pad(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """Pad in reflect/edge/wrap mode as one gather of constant indices (`take`) per padded axis; constant mode is left.

    ORT 1.19.2's Pad gradient exists for constant mode only.
    """
    mode = _text(attr(node, "mode", "constant"))
    if mode not in _NUMPY_PAD_MODES:
        return Declined(f"{mode!r} mode: ORT 1.19.2 differentiates it")
    pads, shape = graph.value(node.input[1]), graph.shape(node.input[0])
    axes = graph.value(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    if pads is None or shape is None:
        raise ExportError(f"{where(node)} pads in {mode!r} mode, which ORT 1.19.2 cannot differentiate, and its "
                          "pads or input shape are not known at export time; give the layer fixed sizes.")
    rank = len(shape)
    axes = np.arange(rank) if axes is None else axes % rank
    count = len(axes)
    padded = [
        (int(axis), int(pads[i]), int(pads[i + count])) for i, axis in enumerate(axes) if pads[i] or pads[i + count]
    ]
    if not all(isinstance(shape[axis], int) for axis, _, _ in padded):
        raise ExportError(f"{where(node)} pads a dimension of unknown size in {mode!r} mode (shape {shape}); "
                          "give that dimension a fixed size.")
    current = node.input[0]
    for position, (axis, before, after) in enumerate(padded):
        index = np.pad(np.arange(int(shape[axis] or 0)), (before, after), mode=_NUMPY_PAD_MODES[mode])  # type: ignore[call-overload]
        output = node.output[0] if position == len(padded) - 1 else None
        current = take(graph, node, current, index.astype(_I64), axis, rank, output)
    if not padded:
        graph.emit("Identity", [current], node, output=node.output[0])
    return graph.take()


def _transposed_weight(graph: Graph, node: onnx.NodeProto, weight: str, shape: list[int], groups: int) -> str:
    """ConvTranspose weight (Cin, Cout/g, k...) -> the Conv weight (Cout, Cin/g, k...) flipped in space."""
    c_in, c_out_g, kernel = shape[0], shape[1], shape[2:]
    grouped = graph.emit("Reshape", [weight, graph.const(np.array([groups, c_in // groups, c_out_g, *kernel], _I64),
                                                         node)], node)
    swapped = graph.emit("Transpose", [grouped], node, perm=[0, 2, 1, *range(3, 3 + len(kernel))])
    current = graph.emit("Reshape", [swapped, graph.const(np.array([groups * c_out_g, c_in // groups, *kernel], _I64),
                                                          node)], node)
    for axis, size in enumerate(kernel, start=2):
        current = take(graph, node, current, np.arange(size)[::-1].astype(_I64), axis, len(shape))
    return current


def conv_transpose(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """ConvTranspose as zero-insertion (a 0/1 MatMul per strided axis) and a Conv with the flipped weight.

    ORT 1.19.2 has no CPU kernel for ConvTransposeGrad.

    Raises:
        ExportError: when sizes are unknown, or for output_shape/auto_pad/padding beyond the kernel.
    """
    x_shape, w_shape = graph.shape(node.input[0]), graph.shape(node.input[1])
    rank = len(w_shape or []) - 2
    strides = [int(s) for s in attr(node, "strides", [1] * rank)]
    dilations = [int(d) for d in attr(node, "dilations", [1] * rank)]
    pads = [int(p) for p in attr(node, "pads", [0] * (2 * rank))]
    extra = [int(p) for p in attr(node, "output_padding", [0] * rank)]
    groups = int(attr(node, "group", 1))
    known = x_shape is not None and w_shape is not None and all(isinstance(d, int) for d in [*x_shape[1:], *w_shape])
    kernel = [int(k or 0) for k in (w_shape or [])[2:]]
    conv_pads = [dilations[a] * (kernel[a] - 1) - pads[a] for a in range(rank)]
    conv_pads += [dilations[a] * (kernel[a] - 1) - pads[a + rank] + extra[a] for a in range(rank)]
    if not known or attr(node, "output_shape", None) or _text(attr(node, "auto_pad", "NOTSET")) != "NOTSET" or min(
        conv_pads, default=0
    ) < 0:
        raise ExportError(
            f"ORT 1.19.2 has no CPU gradient kernel for {where(node)}, and it cannot be rewritten as a Conv (input "
            f"{x_shape}, weight {w_shape}; the rewrite needs static sizes, no output_shape/auto_pad, and padding "
            "within dilation*(kernel-1)); give the layer fixed sizes, or use Upsample + Conv instead."
        )
    current = node.input[0]
    for axis in range(rank):
        if strides[axis] > 1:
            size = int(x_shape[axis + 2] or 0)  # type: ignore[index]
            spread = np.zeros(((size - 1) * strides[axis] + 1, size), np.float32)
            spread[np.arange(size) * strides[axis], np.arange(size)] = 1.0
            current = along_axis(graph, node, current, spread, axis + 2, rank + 2, None)
    weight = _transposed_weight(graph, node, node.input[1], [int(d or 0) for d in w_shape or []], groups)
    graph.emit("Conv", [current, weight, *node.input[2:3]], node, output=node.output[0], group=groups,
               kernel_shape=kernel, dilations=dilations, pads=conv_pads)
    return graph.take()


def _one_direction(graph: Graph, node: onnx.NodeProto, name: str, direction: int) -> str:
    """Slice direction `direction` of a (2, ...) RNN weight or state; '' stays ''."""
    if not name:
        return ""
    bounds = [graph.const(np.array([bound], _I64), node) for bound in (direction, direction + 1, 0)]
    return graph.emit("Slice", [name, *bounds], node)


def bidirectional_rnn(graph: Graph, node: onnx.NodeProto, *, why_kept: str) -> Replacement:
    """A bidirectional LSTM/GRU as two forward ones, the second over the time-reversed sequence.

    ORT 1.19.2's LSTM and GRU training kernels take the forward direction only; `why_kept` says why
    the layer was not unrolled, for the `Declined` of a one-direction layer.

    Raises:
        ExportError: for variable sequence lengths, peepholes, batch-major layout or an unknown length.
    """
    kind = _text(attr(node, "direction", "forward"))
    if kind != "bidirectional":
        return Declined(f"{why_kept}; a {kind} layer is left to ORT's kernel")
    inputs = [*node.input, *[""] * (8 - len(node.input))]
    shape = graph.shape(inputs[0])
    length = shape[0] if shape else None
    if inputs[4] or inputs[7] or int(attr(node, "layout", 0)) or not isinstance(length, int):
        raise ExportError(
            f"ORT 1.19.2 trains {where(node)} in the forward direction only, and this bidirectional one cannot be "
            f"split in two (sequence_lens, peepholes, layout=1 or a sequence length not fixed at export: input "
            f"shape {shape}); export with a fixed sequence length and without packed sequences."
        )
    reverse = np.arange(length)[::-1].astype(_I64)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.name != "direction"}
    state_count = 3 if node.op_type == "LSTM" else 2
    halves = []
    for direction in (0, 1):
        sequence = inputs[0] if direction == 0 else take(graph, node, inputs[0], reverse, 0, 3)
        parts = [_one_direction(graph, node, name, direction) for name in inputs[1:4]]
        states = [_one_direction(graph, node, name, direction) for name in inputs[5:4 + state_count]]
        outputs = [graph.name(f"{node.name}/{direction}_{index}") for index in range(state_count)]
        graph.emitted.append(onnx.helper.make_node(node.op_type, [sequence, *parts, "", *states], outputs,
                                                   name=graph.name(f"{node.name}/{node.op_type}"), **attributes))
        if direction == 1:
            outputs[0] = take(graph, node, outputs[0], reverse, 0, 4)
        halves.append(outputs)
    for index, output in enumerate(node.output):
        if output:
            graph.emit("Concat", [halves[0][index], halves[1][index]], node, output=output, axis=1 if index == 0 else 0)
    return graph.take()


def einsum(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """Einsum as Transpose/Unsqueeze of each operand onto all the equation's letters, Mul, ReduceSum.

    Exact, and any number of operands; the product spans every letter at once, so its memory is the
    product of all index sizes (fine for the small contractions einsum is mostly used for). An
    equation with ``...`` or a letter repeated within one operand (a diagonal) is left to ORT.
    """
    equation = _text(attr(node, "equation", "")).replace(" ", "")
    if "->" not in equation or "..." in equation:
        return Declined(f"equation {equation!r} has no explicit output or has '...'")
    operands, output = equation.split("->")
    terms = operands.split(",")
    if len(terms) != len(node.input) or any(len(set(term)) != len(term) for term in [*terms, output]):
        return Declined(f"equation {equation!r} does not match the inputs or repeats a letter within a term")
    letters = list(output) + sorted({letter for term in terms for letter in term} - set(output))
    aligned = []
    for term, name in zip(terms, node.input, strict=True):
        order = sorted(range(len(term)), key=lambda i: letters.index(term[i]))
        moved = graph.emit("Transpose", [name], node, perm=order) if order != sorted(order) else name
        missing = [axis for axis, letter in enumerate(letters) if letter not in term]
        aligned.append(graph.emit("Unsqueeze", [moved, graph.const(np.array(missing, _I64), node)], node)
                       if missing else moved)
    product = aligned[0]
    for other in aligned[1:]:
        product = graph.emit("Mul", [product, other], node)
    contracted = list(range(len(output), len(letters)))
    if contracted:
        axes = graph.const(np.array(contracted, _I64), node)
        graph.emit("ReduceSum", [product, axes], node, output=node.output[0], keepdims=0)
    else:
        graph.emit("Identity", [product], node, output=node.output[0])
    return graph.take()
