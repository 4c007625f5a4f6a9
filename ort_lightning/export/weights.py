"""Which initializers of an ONNX model are weights to train, and which are constants.

A torch module says which tensors are parameters; an ONNX file does not: exporters also store
scalar factors, shapes, axes, exponents and clip bounds as initializers. Training those (and
AdamW's weight decay shrinking them) changes what the model computes. The rule:

An initializer of an ONNX source trains when all of these hold:

1. its type is floating point (float, double, float16, bfloat16);
2. it has rank >= 1 (a scalar is a constant the exporter stored, such as ``x * 0.5``);
3. it is not a BatchNormalization running statistic (those are buffers, updated by the graph);
4. at least one node reads it at a differentiable input: not as a shape, axes, pads, indices,
   Pow exponent, Dropout ratio, Clip bound, Resize scale or any other input in
   `NON_DIFFERENTIABLE_INPUTS`.

Everything else stays a constant of the graph. ``export_artifacts(..., frozen=[...])`` can still
keep any weight from training.

Example::

    >>> import numpy as np
    >>> from onnx import TensorProto, helper, numpy_helper
    >>> graph = helper.make_graph(
    ...     [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "half"], ["y"])],
    ...     "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    ...     [numpy_helper.from_array(np.ones((3, 4), np.float32), "w"),
    ...      numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    >>> split_initializers(helper.make_model(graph), buffers=set())
    (['w'], ['half'])
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
    """Split the floating-point initializers of `proto` into ``(weights, constants)`` by the module's rule.

    Args:
        proto: the forward model.
        buffers: BatchNormalization running statistics (neither weights nor constants here).

    Returns:
        Sorted names of the weights that train and of the floating-point constants that do not.
    """
    uses = _differentiable_uses(proto.graph)
    weights: list[str] = []
    constants: list[str] = []
    for tensor in proto.graph.initializer:
        if tensor.data_type not in FLOAT_TYPES or tensor.name in buffers:
            continue
        is_weight = len(tensor.dims) >= 1 and uses.get(tensor.name, False)
        (weights if is_weight else constants).append(tensor.name)
    return sorted(weights), sorted(constants)
