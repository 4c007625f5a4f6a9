"""The default ONNX domain, spelled once: which nodes and opsets are ai.onnx's.

Example::

    >>> import onnx
    >>> is_ai_onnx(onnx.helper.make_node("Relu", ["x"], ["y"]))
    True
    >>> graph = onnx.helper.make_graph([], "g", [], [])
    >>> model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    >>> ai_onnx_opset(model)
    17
"""

from __future__ import annotations

from typing import Protocol

import onnx

__all__ = ["AI_ONNX_DOMAINS", "FLOAT_TYPES", "ai_onnx_opset", "is_ai_onnx"]

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
