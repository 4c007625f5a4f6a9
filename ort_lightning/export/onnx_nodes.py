"""ONNX node basics, spelled once: the default domain, the float types, and `NodeBuilder`.

Example::

    >>> builder = NodeBuilder(taken={"x", "scope/Relu"})
    >>> node = builder.node("Relu", ["x"], name="scope/Relu")
    >>> node.name, list(node.output)
    ('scope/Relu_1', ['scope/Relu_out'])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["AI_ONNX_DOMAINS", "FLOAT_TYPES", "NodeBuilder", "ai_onnx_opset", "graph_names", "is_ai_onnx"]

#: The names the default domain goes by: the empty string and its long form.
AI_ONNX_DOMAINS = ("", "ai.onnx")
#: The floating-point ONNX element types: what can be a weight, a gradient or a loss.
FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)


class _HasDomain(Protocol):
    domain: str


def is_ai_onnx(item: _HasDomain) -> bool:
    """True for a node or an opset import of the default (ai.onnx) domain."""
    return item.domain in AI_ONNX_DOMAINS


def ai_onnx_opset(proto: onnx.ModelProto, default: int = 0) -> int:
    """The ai.onnx opset version `proto` imports, or `default` when it imports none."""
    return max((o.version for o in proto.opset_import if is_ai_onnx(o)), default=default)


def graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every value, initializer and node name `graph` uses: what a `NodeBuilder` must not reuse."""
    names = {name for node in graph.node for name in (*node.input, *node.output)}
    names |= {t.name for t in graph.initializer} | {n.name for n in graph.node}
    return names | {i.name for i in graph.input} | {o.name for o in graph.output}


class NodeBuilder:
    """Makes ONNX nodes whose node and output names are new to the graph (`taken` grows as it makes them)."""

    def __init__(self, taken: Iterable[str] = ()) -> None:
        self._taken = set(taken)

    def name(self, base: str) -> str:
        """A value or node name not yet used, derived from `base` (``base``, ``base_1``, ...)."""
        name, suffix = base, 0
        while name in self._taken:
            suffix += 1
            name = f"{base}_{suffix}"
        self._taken.add(name)
        return name

    def node(
        self, op: str, inputs: Sequence[str], *, name: str, output: str | None = None, domain: str | None = None,
        **attributes: Any,
    ) -> onnx.NodeProto:
        """A node called `name` (made unique), with a fresh ``<name>_out`` output unless `output` is given."""
        out = output or self.name(f"{name}_out")
        return helper.make_node(op, list(inputs), [out], name=self.name(name), domain=domain, **attributes)

    def constant(self, array: np.ndarray, *, scope: str) -> onnx.NodeProto:
        """A Constant node under `scope` (not an initializer: it must never become a parameter)."""
        out = self.name(f"{scope}/const")
        return helper.make_node(
            "Constant", [], [out], name=self.name(f"{scope}/Constant"), value=numpy_helper.from_array(array, out)
        )
