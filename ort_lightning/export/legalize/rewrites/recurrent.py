"""nn.LSTM, nn.GRU and nn.RNN unrolled over their fixed sequence length: the `LSTM`, `GRU` and `RNN` rules.

ORT 1.19.2's CPU LSTMGrad and GRUGrad walk the batch one sample and one step at a time with
matrix-vector products: 91% of the benchmarks' LSTM step, 14x torch's backward. The same
recurrence spelled out per step (one MatMul for the input projection of all steps, then per step
a MatMul, Split, Sigmoid, Tanh and Mul) takes the whole batch in each matrix product, and its
gradient is built from ops ORT differentiates well. Exact: ONNX's equations with the default
activations::

    LSTM: i, o, f = sigmoid(x_t W^T + h_{t-1} R^T + Wb + Rb)[i, o, f];  g = tanh(...)[c]
          c_t = f * c_{t-1} + i * g;  h_t = o * tanh(c_t)
    GRU:  z, r = sigmoid(x_t W^T + Wb + h_{t-1} R^T + Rb)[z, r]
          n = tanh((x_t W^T + Wb)[h] + r * (h_{t-1} R^T + Rb)[h])   (linear_before_reset, as torch exports)
          h_t = n + z * (h_{t-1} - n)

A layer that cannot be unrolled (a sequence length not fixed at export or above `MAX_STEPS`,
packed sequences, peepholes, clip, other activations, a GRU without linear_before_reset) keeps
ORT's kernel; a bidirectional one is then split in two forward layers
(`_rewrites_layers.bidirectional_rnn`), as ORT trains the forward direction only. A vanilla RNN
(``h_t = act(x_t W^T + h_{t-1} R^T + Wb + Rb)``, tanh or relu) has no ORT gradient at all: it is
unrolled on the same scaffold, or refused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import Graph, attr, where
from ort_lightning.export.legalize.rewrites.gather import take
from ort_lightning.export.legalize.rewrites.layers import bidirectional_rnn

__all__ = ["MAX_STEPS", "gru", "lstm", "rnn"]

#: Longest sequence unrolled: each step adds about 15 nodes to the forward graph and 30 to its gradient.
MAX_STEPS = 256

_I64 = np.int64
_DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"]}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unrollable(graph: Graph, node: onnx.NodeProto, inputs: list[str]) -> int | Declined:
    """The fixed sequence length of an LSTM/GRU that can be unrolled, else why it cannot."""
    shape = graph.shape(inputs[0])
    length = shape[0] if shape else None
    count = 2 if _text(attr(node, "direction", "forward")) == "bidirectional" else 1
    activations = [_text(a) for a in attr(node, "activations", [])]
    refusals = (
        (not isinstance(length, int) or not 0 < length <= MAX_STEPS,
         f"sequence length {length!r} (input shape {shape}) not fixed at export, or above {MAX_STEPS}"),
        (bool(inputs[4]), "sequence_lens (packed sequences)"),
        (node.op_type == "LSTM" and bool(inputs[7]), "peepholes"),
        (bool(int(attr(node, "layout", 0))), "layout=1"),
        (bool(int(attr(node, "input_forget", 0))), "input_forget"),
        (attr(node, "clip", None) is not None, "clip"),
        (activations not in ([], _DEFAULT_ACTIVATIONS[node.op_type] * count), f"activations {activations}"),
        (node.op_type == "GRU" and not int(attr(node, "linear_before_reset", 0)), "no linear_before_reset"),
    )
    reasons = [reason for refused, reason in refusals if refused]
    if reasons or not isinstance(length, int):
        return Declined(f"not unrolled: {', '.join(reasons)}")
    return length


def lstm(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """The LSTM unrolled when its length is fixed and small enough; otherwise `bidirectional_rnn`'s answer."""
    return _unrolled(graph, node, _lstm_direction, input_count=8)


def gru(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """The GRU unrolled when its length is fixed and small enough; otherwise `bidirectional_rnn`'s answer."""
    return _unrolled(graph, node, _gru_direction, input_count=6)


def _unrolled(
    graph: Graph, node: onnx.NodeProto, direction: Callable[..., tuple[list[str], list[str]]], *, input_count: int
) -> Replacement:
    """Unroll every direction of the layer with `direction`, or leave the layer to `bidirectional_rnn`."""
    inputs = [*node.input, *[""] * (input_count - len(node.input))]
    length = _unrollable(graph, node, inputs)
    if isinstance(length, Declined):
        return bidirectional_rnn(graph, node, why_kept=length.reason)
    return _unroll(graph, node, [
        direction(graph, node, inputs, index, length, backwards) for index, backwards in _directions(node)
    ])


def _directions(node: onnx.NodeProto) -> list[tuple[int, bool]]:
    """(index, runs backwards in time) of each direction of the layer."""
    direction = _text(attr(node, "direction", "forward"))
    if direction == "bidirectional":
        return [(0, False), (1, True)]
    return [(0, direction == "reverse")]


def _unroll(graph: Graph, node: onnx.NodeProto, directions: list[tuple[list[str], list[str]]]) -> list[onnx.NodeProto]:
    """Write the layer's outputs from each direction's (hidden states in time order, [last h, last c])."""
    zero, one = graph.const(np.array([0], _I64), node), graph.const(np.array([1], _I64), node)
    ys, lasts = [], []
    for states, finals in directions:
        if node.output[0]:  # NOTE: no stacked states when only the last ones are read
            stacked = graph.emit("Concat", [graph.emit("Unsqueeze", [s, zero], node) for s in states], node, axis=0)
            ys.append(graph.emit("Unsqueeze", [stacked, one], node))
        lasts.append([graph.emit("Unsqueeze", [final, zero], node) for final in finals])
    outputs = [ys, *([last[i] for last in lasts] for i in range(len(lasts[0])))]
    for position, parts in enumerate(outputs):
        if len(node.output) > position and node.output[position]:
            graph.emit("Concat", parts, node, output=node.output[position], axis=1 if position == 0 else 0)
    return graph.take()


def _part(graph: Graph, node: onnx.NodeProto, name: str, index: int) -> str:
    """Direction `index` of a (D, ...) tensor, without its leading axis."""
    bounds = [graph.const(np.array([bound], _I64), node) for bound in (index, index + 1, 0)]
    return graph.emit("Squeeze", [graph.emit("Slice", [name, *bounds], node), bounds[2]], node)


def _halves(graph: Graph, node: onnx.NodeProto, bias: str, width: int) -> tuple[str, str]:
    """The input and recurrent halves (Wb, Rb) of a direction's (2 * width) bias."""
    bounds = [graph.const(np.array([v], _I64), node) for v in (0, width, 2 * width)]
    return (graph.emit("Slice", [bias, bounds[0], bounds[1]], node),
            graph.emit("Slice", [bias, bounds[1], bounds[2]], node))


def _projections(
    graph: Graph, node: onnx.NodeProto, inputs: list[str], index: int, gates: int, *, both_biases: bool
) -> tuple[str, str, str, str]:
    """What each step of direction `index` reads: projection, recurrent weight, recurrent bias, initial state.

    The input projection of all steps (T, B, gates*H), the transposed recurrent weight (H, gates*H),
    the recurrent bias ('' when added to the projection, or absent) and the initial hidden state ('' for zeros).

    `both_biases` adds ``Wb + Rb`` to the projection (LSTM, RNN); otherwise ``Wb`` alone (GRU, whose ``Rb``
    is inside the reset gate's product).
    """
    hidden = int(attr(node, "hidden_size", 0))
    x, w, r, b, h0 = (inputs[i] for i in (0, 1, 2, 3, 5))
    weight = graph.emit("Transpose", [_part(graph, node, w, index)], node, perm=[1, 0])
    projected = graph.emit("MatMul", [x, weight], node)
    recurrent_bias = ""
    if b:
        input_bias, recurrent_bias = _halves(graph, node, _part(graph, node, b, index), gates * hidden)
        if both_biases:
            input_bias, recurrent_bias = graph.emit("Add", [input_bias, recurrent_bias], node), ""
        projected = graph.emit("Add", [projected, input_bias], node)
    recurrent = graph.emit("Transpose", [_part(graph, node, r, index)], node, perm=[1, 0])
    return projected, recurrent, recurrent_bias, _part(graph, node, h0, index) if h0 else ""


def _times(length: int, backwards: bool) -> range:
    """The time steps of a direction in the order it runs."""
    return range(length - 1, -1, -1) if backwards else range(length)


def _step_gates(graph: Graph, node: onnx.NodeProto, projected: str, t: int, h: str, recurrent: str) -> str:
    """The gates at time step `t`: its input projection, plus ``h_{t-1} R^T`` after the first step."""
    gates = take(graph, node, projected, np.array(t, _I64), 0, 3)
    return graph.emit("Add", [gates, graph.emit("MatMul", [h, recurrent], node)], node) if h else gates


def _lstm_direction(
    graph: Graph, node: onnx.NodeProto, inputs: list[str], index: int, length: int, backwards: bool
) -> tuple[list[str], list[str]]:
    """Unroll direction `index` of an LSTM: its hidden states in time order, the last hidden and cell states."""
    projected, recurrent, _, h = _projections(graph, node, inputs, index, 4, both_biases=True)
    c = _part(graph, node, inputs[6], index) if inputs[6] else ""
    states = []
    for t in _times(length, backwards):
        i, o, f, g = _split(graph, node, _step_gates(graph, node, projected, t, h, recurrent), 4)
        i, o, f = (graph.emit("Sigmoid", [gate], node) for gate in (i, o, f))
        fresh = graph.emit("Mul", [i, graph.emit("Tanh", [g], node)], node)
        c = graph.emit("Add", [graph.emit("Mul", [f, c], node), fresh], node) if c else fresh
        h = graph.emit("Mul", [o, graph.emit("Tanh", [c], node)], node)
        states.append(h)
    return (states[::-1] if backwards else states), [h, c]


def _gru_direction(
    graph: Graph, node: onnx.NodeProto, inputs: list[str], index: int, length: int, backwards: bool
) -> tuple[list[str], list[str]]:
    """Unroll direction `index` of a GRU (linear_before_reset): its hidden states in time order, the last one."""
    projected, recurrent, recurrent_bias, h = _projections(graph, node, inputs, index, 3, both_biases=False)
    states = []
    for t in _times(length, backwards):
        xz, xr, xn = _split(graph, node, take(graph, node, projected, np.array(t, _I64), 0, 3), 3)
        carried = graph.emit("MatMul", [h, recurrent], node) if h else ""
        if carried and recurrent_bias:
            carried = graph.emit("Add", [carried, recurrent_bias], node)
        hz, hr, hn = _split(graph, node, carried or recurrent_bias, 3) if carried or recurrent_bias else ("", "", "")
        z = graph.emit("Sigmoid", [_add(graph, node, xz, hz)], node)
        reset = graph.emit("Sigmoid", [_add(graph, node, xr, hr)], node)
        n = graph.emit("Tanh", [_add(graph, node, xn, graph.emit("Mul", [reset, hn], node) if hn else "")], node)
        if h:
            h = graph.emit("Add", [n, graph.emit("Mul", [z, graph.emit("Sub", [h, n], node)], node)], node)
        else:
            h = graph.emit("Sub", [n, graph.emit("Mul", [z, n], node)], node)  # h_{-1} = 0
        states.append(h)
    return (states[::-1] if backwards else states), [h]


def _rnn_direction(
    graph: Graph, node: onnx.NodeProto, inputs: list[str], index: int, length: int, backwards: bool
) -> tuple[list[str], list[str]]:
    """Unroll direction `index` of a vanilla RNN: its hidden states in time order, the last one."""
    activations = [_text(a) for a in attr(node, "activations", [b"Tanh"])]
    projected, recurrent, _, h = _projections(graph, node, inputs, index, 1, both_biases=True)
    states = []
    for t in _times(length, backwards):
        h = graph.emit(activations[index % len(activations)], [_step_gates(graph, node, projected, t, h, recurrent)],
                       node)
        states.append(h)
    return (states[::-1] if backwards else states), [h]


def rnn(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """nn.RNN (ONNX RNN, no gradient in ORT 1.19.2) unrolled over its fixed length into MatMul/Add/Tanh|Relu.

    Raises:
        ExportError: for a sequence length not fixed at export, sequence_lens, clip or another activation.
    """
    inputs = [*node.input, *[""] * (6 - len(node.input))]
    shape = graph.shape(inputs[0])
    length = shape[0] if shape else None
    activations = [_text(a) for a in attr(node, "activations", [b"Tanh"])]
    reverse_only = _text(attr(node, "direction", "forward")) == "reverse"
    if not isinstance(length, int) or inputs[4] or attr(node, "clip", None) is not None or reverse_only or int(
        attr(node, "layout", 0)
    ) or any(a not in ("Tanh", "Relu") for a in activations):
        raise ExportError(
            f"ORT 1.19.2 has no gradient for {where(node)}, and it cannot be unrolled (input shape {shape}, "
            f"activations {activations}; unrolling needs a sequence length fixed at export, no packed sequences "
            "and tanh/relu); export with a fixed sequence length, or use nn.GRU/nn.LSTM, which ORT trains."
        )
    return _unroll(graph, node, [
        _rnn_direction(graph, node, inputs, index, length, backwards) for index, backwards in _directions(node)
    ])


def _add(graph: Graph, node: onnx.NodeProto, value: str, other: str) -> str:
    """``value + other``, or `value` alone when `other` is absent ('')."""
    return graph.emit("Add", [value, other], node) if other else value


def _split(graph: Graph, node: onnx.NodeProto, gates: str, count: int) -> list[str]:
    """The `count` equal blocks of the last axis of `gates` (ONNX's gate order)."""
    outputs = [graph.name(f"{node.name or node.op_type}/Split_out") for _ in range(count)]
    graph.emitted.append(helper.make_node("Split", [gates], outputs, name=graph.name(f"{node.name}/Split"), axis=-1))
    return outputs
