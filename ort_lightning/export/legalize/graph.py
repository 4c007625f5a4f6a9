"""What a rewrite of `_legalize` works with: a `Graph` that hands out fresh names, shapes and constants.

Example::

    >>> import onnx
    >>> from onnx import helper
    >>> graph = Graph(helper.make_model(helper.make_graph([], "g", [], [])))
    >>> graph.name("x"), graph.name("x")
    ('x', 'x_1')
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx.shape_inference import InferenceError

from ort_lightning.export.external import is_external, read_array
from ort_lightning.export.onnx_nodes import FLOAT_TYPES, NodeBuilder, ai_onnx_opset, graph_names

__all__ = ["SHAPE_INFERENCE_ERRORS", "Graph", "attr", "module_of", "where"]

_log = logging.getLogger("ort_lightning.export.legalize")

#: What ONNX shape inference raises on a graph it cannot infer: an op it does not know (InferenceError),
#: or a model too large to serialize for it (ValueError, above protobuf's 2 GB).
SHAPE_INFERENCE_ERRORS = (InferenceError, ValueError)
#: What the reference evaluator raises on a subgraph it cannot fold: an op or domain it does not know and a
#: missing input (RuntimeError), numpy refusing the operands (TypeError, ValueError), an index or axis out of
#: range (IndexError, numpy's AxisError).
_FOLD_ERRORS = (RuntimeError, TypeError, ValueError, LookupError)


class Graph:
    """What the rewrites need to know about the graph: unique names, its opset, static shapes."""

    def __init__(
        self, proto: onnx.ModelProto, *, padding_rows: dict[str, int] | None = None, weights_dir: Path | None = None
    ) -> None:
        self.proto = proto
        #: Where initializers kept as external data lie (``export.external``).
        self.weights_dir = weights_dir
        #: Embedding weight name -> its padding_idx (from the torch model; ONNX does not say).
        self.padding_rows = dict(padding_rows or {})
        self.opset = ai_onnx_opset(proto, default=17)
        self._builder = NodeBuilder(graph_names(proto.graph))
        self._shapes: dict[str, list[int | str | None]] | None = None
        self._types: dict[str, int] = {}
        self._constants = {t.name: t for t in proto.graph.initializer}
        self._initializers = set(self._constants)
        for node in proto.graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self._constants[node.output[0]] = node.attribute[0].t
        self._producers: dict[str, onnx.NodeProto] | None = None
        #: Nodes emitted by the rewrite in progress; `take` hands them over.
        self.emitted: list[onnx.NodeProto] = []

    def take(self) -> list[onnx.NodeProto]:
        """The nodes emitted since the last `take`."""
        nodes, self.emitted = self.emitted, []
        return nodes

    def emit(self, op: str, inputs: list[str], like: onnx.NodeProto, output: str | None = None, **attrs: Any) -> str:
        """Emit a node named under `like` (its scope survives); return its output name."""
        node = self.node(op, inputs, like, output, **attrs)
        self.emitted.append(node)
        return node.output[0]

    def const(self, array: np.ndarray, like: onnx.NodeProto) -> str:
        """Emit a Constant node; return its output name."""
        node = self.constant(array, like)
        self.emitted.append(node)
        return node.output[0]

    def value(self, name: str) -> np.ndarray | None:
        """The value of `name` when it does not depend on the inputs (a constant, or a subgraph of constants).

        Returns None for a value computed from the graph inputs, and for an empty name.
        """
        tensor = self._constants.get(name) if name else None
        if tensor is not None:
            return read_array(tensor, self.weights_dir)
        return self._fold(name) if name else None

    def _fold(self, name: str, limit: int = 64) -> np.ndarray | None:
        """Evaluate the constant subgraph that computes `name` (the exporter writes pads that way)."""
        if self._producers is None:
            self._producers = {output: node for node in self.proto.graph.node for output in node.output}
        producers = self._producers
        needed: list[onnx.NodeProto] = []
        stack, seen = [name], set()
        while stack:
            value = stack.pop()
            if value in self._constants and is_external(self._constants[value]):
                return None  # NOTE: a weight kept outside the graph is never folded into a Constant
            if value in seen or value in self._constants or not value:
                continue
            seen.add(value)
            node = producers.get(value)
            if node is None or node.op_type in _NOT_FOLDABLE or len(needed) >= limit:
                return None
            needed.append(node)
            stack.extend(node.input)
        constants = [helper.make_node("Constant", [], [n], value=self._constants[n]) for n in _inputs_of(needed)
                     if n in self._constants]
        nodes = constants + sorted(needed, key=list(self.proto.graph.node).index)
        graph = helper.make_graph(nodes, "fold", [], [helper.make_tensor_value_info(name, 0, None)])
        try:
            model = helper.make_model(graph, opset_imports=self.proto.opset_import)
            (result,) = ReferenceEvaluator(model).run(None, {})
        except _FOLD_ERRORS as error:  # the value then stays unknown: a rewrite that needs it declines or refuses
            _log.debug("cannot fold the constant %r: %s: %s", name, type(error).__name__, error)
            return None
        return np.asarray(result)

    def name(self, base: str) -> str:
        """A value or node name not yet used in the graph, derived from `base`."""
        return self._builder.name(base)

    def is_weight(self, name: str) -> bool:
        """Whether `name` is a floating-point initializer: a weight ORT may train."""
        tensor = self._constants.get(name)
        return tensor is not None and name in self._initializers and tensor.data_type in FLOAT_TYPES

    def is_float(self, value: str) -> bool:
        """Whether shape inference says `value` is a floating-point tensor (one gradients flow through)."""
        return self.elem_type(value) in FLOAT_TYPES

    def elem_type(self, value: str) -> int | None:
        """The ``onnx.TensorProto`` element type of `value` that shape inference finds, None if unknown."""
        self.shape(value)
        return self._types.get(value)

    def shape(self, value: str) -> list[int | str | None] | None:
        """Dimensions of `value` (ints, symbolic names, None if unknown), from ONNX shape inference."""
        if self._shapes is None:
            self._shapes, self._types = _infer_shapes(self.proto)
        return self._shapes.get(value)

    def node(
        self, op: str, inputs: list[str], like: onnx.NodeProto, output: str | None = None, **attrs: Any
    ) -> onnx.NodeProto:
        """A new node named under `like` (so its scope survives), with a fresh output unless given."""
        return self._builder.node(op, inputs, name=f"{like.name or like.op_type}/{op}", output=output, **attrs)

    def constant(self, array: np.ndarray, like: onnx.NodeProto) -> onnx.NodeProto:
        """A Constant node (not an initializer: it must never become a parameter)."""
        return self._builder.constant(array, scope=like.name or like.op_type)


def module_of(node_name: str) -> str:
    """The torch module a TorchScript-exported node came from (the exporter names nodes by module scope).

    Example::

        >>> module_of("/encoder/layers.0/norm1/LayerNormalization")
        'encoder.layers.0.norm1'
    """
    parts = [part for part in node_name.split("/") if part]
    return ".".join(parts[:-1]) or "<top level>"


def where(node: onnx.NodeProto) -> str:
    """``op 'X' (domain 'd') at node 'n' (torch module 'm')``, for error messages."""
    return (
        f"the ONNX op {node.op_type!r} (domain {node.domain or 'ai.onnx'!r}) at node {node.name!r} "
        f"(torch module {module_of(node.name)!r})"
    )


#: Ops whose value depends on more than their inputs' values, or that read a graph input's shape.
_NOT_FOLDABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
                 "Dropout", "If", "Loop", "Scan"}


def _inputs_of(nodes: list[onnx.NodeProto]) -> set[str]:
    return {name for node in nodes for name in node.input if name}




def _infer_shapes(proto: onnx.ModelProto) -> tuple[dict[str, list[int | str | None]], dict[str, int]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except SHAPE_INFERENCE_ERRORS as error:  # shapes stay unknown: a rewrite that needs one declines or refuses
        _log.debug("shape inference failed, shapes stay unknown: %s", error)
        inferred = proto
    shapes: dict[str, list[int | str | None]] = {}
    graph = inferred.graph
    infos = [*graph.input, *graph.value_info, *graph.output]
    types = {info.name: info.type.tensor_type.elem_type for info in infos if info.type.tensor_type.elem_type}
    for info in infos:
        if not info.type.tensor_type.HasField("shape"):
            continue
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]
    for tensor in graph.initializer:
        shapes.setdefault(tensor.name, list(tensor.dims))
        types[tensor.name] = tensor.data_type
    return shapes, types


def attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """The value of `node`'s attribute `name`, or `default` when the node does not set it."""
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default
