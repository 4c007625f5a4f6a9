"""Files ONNX Runtime reads: checkpoint summaries, a graph file's inputs and outputs, what an optimizer runs.

Graph files may be ``.onnx`` or ``.ort``.

A running session writes its own files (`ort_lightning.ort.session.TrainingSession.save`,
``export_for_inferencing``).
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from ort_lightning.errors import ArtifactError
from ort_lightning.ort._api import (
    CheckpointState,
    bound_state,
    onnxruntime,
)
from ort_lightning.ort._api import capi as _C
from ort_lightning.ort._api import ort_flatbuffers as _fbs
from ort_lightning.ort.generate import OPTIMIZER_NODES as _OPTIMIZER_NODES
from ort_lightning.ort.generate import optimizer_kind_of
from ort_lightning.ort.graph_files import load_graph
from ort_lightning.ort.options import session_options

__all__ = [
    "CHECKPOINT_READ_ERRORS",
    "WRITE_ERRORS",
    "checkpoint_summary",
    "nominal_summary",
    "nominal_summary_of",
    "optimizer_kind_in",
    "ort_graph_io",
    "ort_metadata",
    "ort_node_attributes",
    "summary_of",
]


def ort_graph_io(path: os.PathLike[str] | str) -> tuple[list[tuple[str, str, tuple[int | str, ...]]], list[str]]:
    """Inputs ``(name, numpy dtype name, shape)`` and output names of a graph ONNX Runtime loads (``.ort`` too).

    Raises:
        ArtifactError: for a file ONNX Runtime cannot load as a graph.
    """
    try:
        session = onnxruntime.InferenceSession(
            os.fspath(path), sess_options=session_options(), providers=["CPUExecutionProvider"]
        )
    except (RuntimeError, _C.Fail, _C.InvalidArgument, _C.InvalidGraph, _C.InvalidProtobuf) as error:
        raise ArtifactError(
            f"ONNX Runtime cannot load {os.fspath(path)} ({' '.join(str(error).split())[:200]}); the file is "
            "damaged or truncated: copy it again from where the artifacts were generated, or regenerate them."
        ) from error
    inputs = []
    for arg in session.get_inputs():
        dtype = _ORT_TYPES.get(arg.type, arg.type)
        shape = tuple(dim if isinstance(dim, int | str) else "?" for dim in arg.shape or ())
        inputs.append((arg.name, dtype, shape))
    return inputs, [arg.name for arg in session.get_outputs()]


def ort_node_attributes(path: os.PathLike[str] | str, op_types: Sequence[str]) -> dict[str, float | int]:
    """The float and int attributes of the first node of `op_types` in an ``.ort`` graph (empty if none).

    Read with the flatbuffers readers ONNX Runtime ships (``onnxruntime.tools.ort_format_model``),
    as ORT would run them; onnx cannot read the format.

    Raises:
        ArtifactError: for a file that is not an ``.ort`` graph.
    """
    with _ort_model(path) as model:
        graph = model.Graph()
        nodes = [graph.Nodes(index) for index in range(graph.NodesLength())]
        node = next((n for n in nodes if n.OpType().decode() in op_types), None)
    if node is None:
        return {}
    readers = {_fbs.AttributeType.AttributeType.FLOAT: "F", _fbs.AttributeType.AttributeType.INT: "I"}
    attributes = [node.Attributes(index) for index in range(node.AttributesLength())]
    return {a.Name().decode(): getattr(a, readers[a.Type()])() for a in attributes if a.Type() in readers}


def ort_metadata(path: os.PathLike[str] | str) -> dict[str, str]:
    """The model metadata (``metadata_props``) of an ``.ort`` graph, which ORT's converter keeps from the ``.onnx`` one.

    Raises:
        ArtifactError: for a file that is not an ``.ort`` graph.
    """
    with _ort_model(path) as model:
        entries = [model.MetadataProps(index) for index in range(model.MetadataPropsLength())]
        return {entry.Key().decode(): entry.Value().decode() for entry in entries}


#: What reading an ``.ort`` graph raises for a file that is not one: the OS's errors, and the flatbuffers
#: readers' on a damaged buffer (struct.error, IndexError past its end, TypeError for a bad offset,
#: AttributeError for a missing table, UnicodeDecodeError for a name that is not text).
_ORT_GRAPH_ERRORS = (OSError, struct.error, IndexError, TypeError, AttributeError, UnicodeDecodeError)


@contextlib.contextmanager
def _ort_model(path: os.PathLike[str] | str) -> Iterator[Any]:
    """The flatbuffers Model of an ``.ort`` graph, read within the block; an `ArtifactError` if it is not one."""
    try:
        with open(path, "rb") as stream:
            yield _fbs.InferenceSession.InferenceSession.GetRootAs(stream.read(), 0).Model()
    except _ORT_GRAPH_ERRORS as error:
        raise ArtifactError(
            f"{os.fspath(path)} is not an ONNX Runtime .ort graph ({type(error).__name__}: {error}); copy it again "
            "from where the artifacts were generated, or regenerate them."
        ) from error


#: ONNX Runtime's type strings -> numpy dtype names (what `TensorSpec` records).
_ORT_TYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
}


def checkpoint_summary(path: os.PathLike[str] | str) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, Any]]:
    """Read a CheckpointState file: ``(name, shape, requires_grad)`` per parameter, and its properties."""
    return summary_of(CheckpointState.load_checkpoint(os.fspath(path)))


def summary_of(state: Any) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, Any]]:
    """``(name, shape, requires_grad)`` per parameter of ORT's CheckpointState `state`, and its properties.

    Raises:
        RuntimeError: (one of `CHECKPOINT_READ_ERRORS`) for a nominal state (its parameters hold no data yet).
    """
    bound = bound_state(state)
    parameters = []
    for name in bound.parameter_names():
        parameter = bound.get_parameter(name)
        parameters.append((name, tuple(parameter.data.shape()), bool(parameter.requires_grad)))
    properties = {name: bound.get_property(name) for name in bound.property_names()}
    return parameters, properties


def nominal_summary(path: os.PathLike[str] | str) -> tuple[list[str], dict[str, Any]] | None:
    """The parameter names and properties of a nominal checkpoint; None for a checkpoint that holds weights.

    A nominal checkpoint (``generate_artifacts(..., nominal_checkpoint=True)``) lists the parameters
    without their data; ONNX Runtime refuses to read any parameter of it until
    ``Module.copy_buffer_to_parameters`` has given the weights, and says so ("nominal state").

    Raises:
        RuntimeError: (one of `CHECKPOINT_READ_ERRORS`) for a file ONNX Runtime cannot read at all.
    """
    return nominal_summary_of(CheckpointState.load_checkpoint(os.fspath(path)))


def nominal_summary_of(state: Any) -> tuple[list[str], dict[str, Any]] | None:
    """`nominal_summary` of ORT's CheckpointState `state`, already read."""
    bound = bound_state(state)
    names = list(bound.parameter_names())
    try:
        for name in names[:1]:
            bound.get_parameter(name)
    except RuntimeError as error:
        if "nominal state" not in str(error):
            raise
        return names, {name: bound.get_property(name) for name in bound.property_names()}
    return None


#: What ONNX Runtime raises for a checkpoint file it cannot parse.
CHECKPOINT_READ_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, _C.Fail, _C.InvalidArgument, _C.NoSuchFile)

#: What writing a file may raise: the OS's errors, and ONNX Runtime's for a checkpoint or model it could not write
#: (a full disk gives a RuntimeError whose text says "errno:28" for a checkpoint, "Protobuf serialization failed"
#: for an inference model).
WRITE_ERRORS: tuple[type[BaseException], ...] = (OSError, *CHECKPOINT_READ_ERRORS)


def optimizer_kind_in(optimizer_model: os.PathLike[str] | str) -> str:
    """Read ``"adamw"`` or ``"sgd"`` from an optimizer graph (``.onnx`` or ``.ort``).

    Raises:
        ArtifactError: for a graph with neither optimizer node.
    """
    nodes = _optimizer_nodes(os.fspath(optimizer_model))
    kind = optimizer_kind_of(nodes)
    if kind is None:
        raise ArtifactError(
            f"Optimizer graph {os.fspath(optimizer_model)} has nodes {sorted(set(nodes))} but no "
            f"{' or '.join(_OPTIMIZER_NODES)} node; re-export the artifacts with "
            "export_artifacts(..., optimizer='adamw' or 'sgd')."
        )
    return kind


def _optimizer_nodes(path: str) -> list[str]:
    """Node types of an optimizer graph; for an ``.ort`` graph, what its inputs and operator list say."""
    if not path.endswith(".ort"):
        advice = ("it is damaged or truncated: copy the artifacts again from where they were exported, or re-export "
                  "them with export_artifacts()")
        return [node.op_type for node in load_graph(path, advice=advice).graph.node]
    config = path[: -len(".ort")] + ".required_operators.config"
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as stream:
                return [op for line in stream if not line.startswith("#")
                        for op in line.strip().split(";")[-1].split(",")]
        except UnicodeDecodeError as error:
            raise ArtifactError(
                f"{config} is not UTF-8 text ({error.reason} at byte {error.start}), so it is not the operator list "
                f"that ONNX Runtime's converter wrote beside {os.path.basename(path)}; copy it again from where the "
                "artifacts were exported, or delete it (the optimizer kind is then read from the graph's inputs)."
            ) from error
    # NOTE: without the operator list, the inputs tell: only AdamW keeps second-order moments.
    inputs, _ = ort_graph_io(path)
    return ["AdamWOptimizer" if any(name == "second_order_moments" for name, _, _ in inputs) else "SGDOptimizerV2"]
