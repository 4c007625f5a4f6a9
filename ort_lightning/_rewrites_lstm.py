"""nn.LSTM unrolled over its fixed sequence length: the `LSTM` rule of `_legalize.RULES`.

ORT 1.19.2's CPU LSTMGrad walks the batch one sample and one step at a time with
matrix-vector products: 91% of the benchmarks' LSTM step, 14x torch's backward. The same
recurrence spelled out per step (one MatMul for the input projection of all steps, then per step
a MatMul, Split, Sigmoid, Tanh and Mul) takes the whole batch in each matrix product, and its
gradient is built from ops ORT differentiates well. Exact: ONNX's LSTM equations with the default
activations::

    i, o, f = sigmoid(x_t W^T + h_{t-1} R^T + Wb + Rb)[i, o, f];  g = tanh(...)[c]
    c_t = f * c_{t-1} + i * g;  h_t = o * tanh(c_t)

An LSTM that cannot be unrolled (a sequence length not fixed at export or above `MAX_STEPS`,
packed sequences, peepholes, clip, other activations) keeps ORT's kernel; a bidirectional one is
then split in two forward LSTMs (`_rewrites_layers.bidirectional_rnn`), as ORT trains the forward
direction only.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from ort_lightning._rewrites_gather import take
from ort_lightning._rewrites_layers import bidirectional_rnn
from ort_lightning._rewriting import Graph, attr

__all__ = ["MAX_STEPS", "lstm"]

#: Longest sequence unrolled: each step adds about 15 nodes to the forward graph and 30 to its gradient.
MAX_STEPS = 256

_I64 = np.int64
_DEFAULT_ACTIVATIONS = ["Sigmoid", "Tanh", "Tanh"]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def lstm(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The LSTM unrolled when its length is fixed and small enough; otherwise `bidirectional_rnn`'s answer."""
    inputs = [*node.input, *[""] * (8 - len(node.input))]
    shape = graph.shape(inputs[0])
    length = shape[0] if shape else None
    direction = _text(attr(node, "direction", "forward"))
    count = 2 if direction == "bidirectional" else 1
    activations = [_text(a) for a in attr(node, "activations", [])]
    if (
        not isinstance(length, int)
        or not 0 < length <= MAX_STEPS
        or inputs[4]  # sequence_lens: packed sequences
        or inputs[7]  # peepholes
        or int(attr(node, "layout", 0))
        or int(attr(node, "input_forget", 0))
        or attr(node, "clip", None) is not None
        or activations not in ([], _DEFAULT_ACTIVATIONS * count)
    ):
        return bidirectional_rnn(graph, node)
    hidden = int(attr(node, "hidden_size", 0))
    zero, one = graph.const(np.array([0], _I64), node), graph.const(np.array([1], _I64), node)
    ys, hs, cs = [], [], []
    for index in range(count):
        backwards = direction == "reverse" or index == 1
        states, last_h, last_c = _direction(graph, node, inputs, index, length, hidden, backwards)
        stacked = graph.emit("Concat", [graph.emit("Unsqueeze", [s, zero], node) for s in states], node, axis=0)
        ys.append(graph.emit("Unsqueeze", [stacked, one], node))
        hs.append(graph.emit("Unsqueeze", [last_h, zero], node))
        cs.append(graph.emit("Unsqueeze", [last_c, zero], node))
    for position, parts in enumerate((ys, hs, cs)):
        if len(node.output) > position and node.output[position]:
            graph.emit("Concat", parts, node, output=node.output[position], axis=1 if position == 0 else 0)
    return graph.take()


def _direction(
    graph: Graph, node: onnx.NodeProto, inputs: list[str], index: int, length: int, hidden: int, backwards: bool
) -> tuple[list[str], str, str]:
    """Unroll direction `index`: its hidden states in time order, the last hidden and cell states."""

    def part(name: str) -> str:  # direction `index` of a (D, ...) tensor, without its leading axis
        bounds = [graph.const(np.array([bound], _I64), node) for bound in (index, index + 1, 0)]
        return graph.emit("Squeeze", [graph.emit("Slice", [name, *bounds], node), bounds[2]], node)

    x, w, r, b, h0, c0 = (inputs[i] for i in (0, 1, 2, 3, 5, 6))
    projected = graph.emit("MatMul", [x, graph.emit("Transpose", [part(w)], node, perm=[1, 0])], node)  # (T, B, 4H)
    if b:
        bias = part(b)
        halves = [graph.const(np.array([v], _I64), node) for v in (0, 4 * hidden, 8 * hidden)]
        both = graph.emit("Add", [graph.emit("Slice", [bias, halves[0], halves[1]], node),
                                  graph.emit("Slice", [bias, halves[1], halves[2]], node)], node)
        projected = graph.emit("Add", [projected, both], node)
    recurrent = graph.emit("Transpose", [part(r)], node, perm=[1, 0])  # (H, 4H)
    h, c = (part(h0) if h0 else ""), (part(c0) if c0 else "")
    states = []
    for step in range(length):
        t = length - 1 - step if backwards else step
        gates = take(graph, node, projected, np.array(t, _I64), 0, 3)
        if h:
            gates = graph.emit("Add", [gates, graph.emit("MatMul", [h, recurrent], node)], node)
        i, o, f, g = _split4(graph, node, gates)
        i, o, f = (graph.emit("Sigmoid", [gate], node) for gate in (i, o, f))
        fresh = graph.emit("Mul", [i, graph.emit("Tanh", [g], node)], node)
        c = graph.emit("Add", [graph.emit("Mul", [f, c], node), fresh], node) if c else fresh
        h = graph.emit("Mul", [o, graph.emit("Tanh", [c], node)], node)
        states.append(h)
    return (states[::-1] if backwards else states), h, c


def _split4(graph: Graph, node: onnx.NodeProto, gates: str) -> list[str]:
    """The i, o, f, c blocks of a (B, 4H) gate tensor (ONNX's gate order)."""
    outputs = [graph.name(f"{node.name or node.op_type}/Split_out") for _ in range(4)]
    graph.emitted.append(helper.make_node("Split", [gates], outputs, name=graph.name(f"{node.name}/Split"), axis=1))
    return outputs
