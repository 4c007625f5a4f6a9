"""Gathers as ops whose CPU gradients are fast: the `Gather` rule of `_legalize.RULES`, and `take`.

ORT 1.19.2's CPU GatherGrad takes a mutex for every element of the incoming gradient. A constant
position or ascending run becomes Slice; any other index along axis 0 (embeddings) GatherND; a
constant 1-d index along another axis GatherND on a transposed tensor. Other Gathers stay ORT's.
"""

from __future__ import annotations

import numpy as np
import onnx

from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import Graph, attr

__all__ = ["gather", "take"]

_I64 = np.int64
_END = np.iinfo(np.int64).max


def gather(graph: Graph, node: onnx.NodeProto) -> Replacement:
    """A Gather on the gradient path as Slice or GatherND (padding rows kept); else `Declined`."""
    data, indices = node.input[0], node.input[1]
    weight = graph.is_weight(data)
    if not weight and not graph.is_float(data):
        # NOTE: shape inference reads these Gathers; a rewritten one would hide the shapes it computes
        return Declined("not on the gradient path (shape arithmetic or integer data)")
    axis = int(attr(node, "axis", 0))
    shape = graph.shape(data)
    if axis < 0 and shape is not None:
        axis += len(shape)
    if weight and data in graph.padding_rows and axis == 0:
        return _padded_lookup(graph, node)
    index = graph.value(indices)
    if index is not None and shape is not None and axis >= 0 and (axis == 0 or index.ndim <= 1):
        take(graph, node, data, index, axis, len(shape), node.output[0])
        return graph.take()
    if axis != 0:
        return Declined(f"index computed from the inputs along axis {axis}: GatherND takes axis 0 only")
    graph.emit("GatherND", [data, _nd_positions(graph, node, indices)], node, output=node.output[0])
    return graph.take()


def take(graph: Graph, node: onnx.NodeProto, data: str, index: np.ndarray, axis: int, rank: int,
         output: str | None = None) -> str:
    """Emit ``Gather(data, index, axis)`` for a constant `index` without ORT's GatherGrad; return its output."""
    flat = index.reshape(-1).astype(_I64)
    ascending_run = index.ndim == 1 and flat.size > 0 and flat.min() >= 0 and bool((np.diff(flat) == 1).all())
    if index.ndim == 0 or ascending_run:
        return _slice(graph, node, data, index, axis, output)
    if axis == 0:
        return graph.emit("GatherND", [data, graph.const(index.astype(_I64)[..., None], node)], node, output=output)
    if index.ndim != 1:
        raise ValueError(f"take: a {index.ndim}-d index along axis {axis}; only along axis 0")
    front = [axis, *(i for i in range(rank) if i != axis)]
    moved = graph.emit("Transpose", [data], node, perm=front)
    gathered = graph.emit("GatherND", [moved, graph.const(flat[:, None], node)], node)
    return graph.emit("Transpose", [gathered], node, output=output, perm=[int(i) for i in np.argsort(front)])


def _slice(graph: Graph, node: onnx.NodeProto, data: str, index: np.ndarray, axis: int, output: str | None) -> str:
    """A scalar index (Slice, Squeeze) or an ascending run (Slice) along `axis`."""
    first, count = int(index.reshape(-1)[0]), max(int(index.size), 1)
    # NOTE: a slice ending at -1 + 1 = 0 would be empty; the last position ends at the axis' end.
    stop = first + count if first + count != 0 else _END
    bounds = [graph.const(np.array([value], _I64), node) for value in (first, stop, axis)]
    if index.ndim == 1:
        return graph.emit("Slice", [data, *bounds], node, output=output)
    return graph.emit("Squeeze", [graph.emit("Slice", [data, *bounds], node), bounds[2]], node, output=output)


def _nd_positions(graph: Graph, node: onnx.NodeProto, indices: str) -> str:
    """Gather's indices as GatherND's: int64 (all GatherND takes), with a trailing axis of one."""
    ids = graph.emit("Cast", [indices], node, to=onnx.TensorProto.INT64)
    return graph.emit("Unsqueeze", [ids, graph.const(np.array([-1], _I64), node)], node)


def _padded_lookup(graph: Graph, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """nn.Embedding(padding_idx=p): the padding row gets no gradient, as in torch.

    NOTE: torch's AdamW still decays the padding row; here it stays as exported (the same for the
    usual all-zero row).
    """
    weight, row = node.input[0], graph.padding_rows[node.input[0]]
    positions = _nd_positions(graph, node, node.input[1])
    gathered = graph.emit("GatherND", [weight, positions], node)
    hit = graph.emit("Equal", [positions, graph.const(np.array(row, _I64), node)], node)
    is_pad = graph.emit("Cast", [hit], node, to=onnx.TensorProto.FLOAT)
    keep = graph.emit("Sub", [graph.const(np.array(1.0, np.float32), node), is_pad], node)
    table = graph.value(weight)
    assert table is not None  # an initializer: `gather` checked
    padding = graph.emit("Mul", [is_pad, graph.const(table[row].astype(np.float32), node)], node)
    graph.emit("Add", [graph.emit("Mul", [gathered, keep], node), padding], node, output=node.output[0])
    return graph.take()
