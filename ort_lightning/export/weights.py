"""Which initializers of an ONNX model are weights to train, and which are constants.

An ONNX file does not say which tensors are parameters, and training a stored scalar or shape
changes what the model computes. A floating-point initializer of rank >= 1, not a BatchNorm
running statistic, read by some node at a differentiable input (not in
`NON_DIFFERENTIABLE_INPUTS`) trains; everything else stays a constant.
"""

from __future__ import annotations

from collections import defaultdict

import onnx

from ort_lightning.export.onnx_nodes import FLOAT_TYPES

__all__ = ["NON_DIFFERENTIABLE_INPUTS", "split_initializers"]

_ALL = frozenset(range(16))
_REDUCE_AXES = frozenset({1})

#: op_type -> input positions that take no gradient (shapes, axes, indices, bounds, rates, exponents).
NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}), "Split": frozenset({1}),
    "Pad": frozenset({1, 2, 3}), "Resize": frozenset({1, 2, 3}), "Upsample": frozenset({1}),
    "Pow": frozenset({1}), "Dropout": frozenset({1, 2}), "Clip": frozenset({1, 2}), "TopK": frozenset({1}),
    "Gather": frozenset({1}), "GatherElements": frozenset({1}), "GatherND": frozenset({1}),
    "ScatterElements": frozenset({1}), "ScatterND": frozenset({1}), "CumSum": frozenset({1}),
    "Where": frozenset({0}), "BatchNormalization": frozenset({3, 4}),
    "SoftmaxCrossEntropyLoss": frozenset({1, 2}), "NegativeLogLikelihoodLoss": frozenset({1, 2}),
    "ReduceSum": _REDUCE_AXES, "ReduceMean": _REDUCE_AXES, "ReduceMax": _REDUCE_AXES, "ReduceMin": _REDUCE_AXES,
    "ReduceProd": _REDUCE_AXES, "ReduceL1": _REDUCE_AXES, "ReduceL2": _REDUCE_AXES,
    "ReduceLogSumExp": _REDUCE_AXES, "ReduceSumSquare": _REDUCE_AXES,
    **{op: _ALL for op in ("Shape", "Size", "ConstantOfShape", "Range", "OneHot", "NonZero", "Equal", "Less",
                           "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN",
                           "IsInf", "Sign", "ArgMax", "ArgMin", "RandomNormalLike", "RandomUniformLike")},
}


def _differentiable_uses(graph: onnx.GraphProto) -> dict[str, bool]:
    """Initializer name -> whether any node reads it at a differentiable input."""
    uses: dict[str, bool] = defaultdict(bool)
    for node in graph.node:
        skipped = NON_DIFFERENTIABLE_INPUTS.get(node.op_type, frozenset())
        for position, name in enumerate(node.input):
            uses[name] |= position not in skipped
    return uses


def split_initializers(proto: onnx.ModelProto, *, buffers: set[str]) -> tuple[list[str], list[str]]:
    """Split `proto`'s floating-point initializers into sorted ``(weights, constants)``; `buffers` are neither."""
    uses = _differentiable_uses(proto.graph)
    weights: list[str] = []
    constants: list[str] = []
    for tensor in proto.graph.initializer:
        if tensor.data_type not in FLOAT_TYPES or tensor.name in buffers:
            continue
        is_weight = len(tensor.dims) >= 1 and uses.get(tensor.name, False)
        (weights if is_weight else constants).append(tensor.name)
    return sorted(weights), sorted(constants)
