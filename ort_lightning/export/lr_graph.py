"""The learning rate computed inside an optimizer graph, for runtimes that cannot set one.

`bake_lr` rewires the optimizer node's ``learning_rate`` input to nodes that compute the rate (a
constant, or the linear schedule from the ``step`` input); the input stays, ignored. ORT feeds
``step`` = completed updates + 1, so the schedule takes ``s = step - 1`` in float64 and casts to
float32 once: the module scheduler's rate, bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from ort_lightning.artifacts.schedule import METADATA_KEY, GraphSchedule
from ort_lightning.errors import ExportError
from ort_lightning.export.onnx_nodes import NodeBuilder, graph_names

__all__ = ["LR_INPUT", "STEP_INPUT", "bake_lr"]

#: The optimizer graph's inputs that ORT feeds: the rate it was given, and completed updates + 1.
LR_INPUT, STEP_INPUT = "learning_rate", "step"
_OPTIMIZER_OPS = ("AdamWOptimizer", "SGDOptimizerV2")
_SCOPE = "lr_schedule"


def bake_lr(proto: onnx.ModelProto, schedule: GraphSchedule) -> None:
    """Make the optimizer graph `proto` compute its learning rate as `schedule` says, in place.

    Raises:
        ExportError: for a graph without one optimizer node reading ``learning_rate``, or a linear
            schedule on a graph without the ``step`` input.
    """
    node = _optimizer_node(proto)
    graph = proto.graph
    if schedule.kind == "linear" and STEP_INPUT not in {value.name for value in graph.input}:
        raise ExportError(
            f"The optimizer graph has no '{STEP_INPUT}' input (it takes {[v.name for v in graph.input]}), and a "
            "linear schedule is computed from the optimizer steps ONNX Runtime feeds there; use "
            "lr_scheduler='constant', or prepare a folder that generate_artifacts()/export_artifacts() wrote."
        )
    builder = NodeBuilder(graph_names(graph))
    nodes = _constant(builder, schedule) if schedule.kind == "constant" else _linear(builder, schedule)
    node.input[0] = nodes[-1].output[0]
    index = next(position for position, candidate in enumerate(graph.node) if candidate is node)
    for offset, new in enumerate(nodes):
        graph.node.insert(index + offset, new)
    entries = {entry.key: entry for entry in proto.metadata_props}
    entry = entries.get(METADATA_KEY) or proto.metadata_props.add(key=METADATA_KEY)
    entry.value = json.dumps(asdict(schedule))


def _optimizer_node(proto: onnx.ModelProto) -> onnx.NodeProto:
    nodes = [node for node in proto.graph.node if node.op_type in _OPTIMIZER_OPS]
    if len(nodes) != 1:
        raise ExportError(
            f"Expected an optimizer graph with one {' or '.join(_OPTIMIZER_OPS)} node, but found "
            f"{[node.op_type for node in nodes] or 'none'}; pass a folder whose optimizer_model.onnx "
            "generate_artifacts()/export_artifacts() wrote."
        )
    node = nodes[0]
    if node.input[0] != LR_INPUT:
        raise ExportError(
            f"The {node.op_type} node reads its learning rate from {node.input[0]!r}, not from the graph input "
            f"'{LR_INPUT}': this optimizer graph already computes its rate (a folder prepare_for_web() wrote?); "
            "prepare the folder that export_artifacts() wrote instead."
        )
    return node


def _constant(builder: NodeBuilder, schedule: GraphSchedule) -> list[onnx.NodeProto]:
    return [builder.constant(np.array([schedule.lr], dtype=np.float32), scope=_SCOPE)]


def _linear(builder: NodeBuilder, schedule: GraphSchedule) -> list[onnx.NodeProto]:
    """``lr * (s / max(1, W) if s < W else max(0, (T - s) / max(1, T - W)))`` with ``s = step - 1``, in float64."""
    total = int(schedule.total_steps or 0)
    warmup = schedule.warmup_steps

    def constant(value: float | int, dtype: type) -> onnx.NodeProto:
        return builder.constant(np.array([value], dtype=dtype), scope=_SCOPE)

    one, warmup_c, warmup_d, total_c, decay_d, zero, peak = (
        constant(1, np.int64), constant(warmup, np.float64), constant(max(1, warmup), np.float64),
        constant(total, np.float64), constant(max(1, total - warmup), np.float64), constant(0.0, np.float64),
        constant(schedule.lr, np.float64),
    )
    nodes = [one, warmup_c, warmup_d, total_c, decay_d, zero, peak]

    def add(op: str, *inputs: onnx.NodeProto | str, **attributes: Any) -> str:
        names = [item if isinstance(item, str) else item.output[0] for item in inputs]
        nodes.append(builder.node(op, names, name=f"{_SCOPE}/{op}", **attributes))
        return str(nodes[-1].output[0])

    # NOTE: ORT feeds `step` = completed updates + 1 (measured); the schedule counts completed ones.
    done = add("Cast", add("Sub", STEP_INPUT, one), to=TensorProto.DOUBLE)
    warming = add("Div", done, warmup_d)
    decaying = add("Max", add("Div", add("Sub", total_c, done), decay_d), zero)
    factor = add("Where", add("Less", done, warmup_c), warming, decaying)
    add("Cast", add("Mul", factor, peak), to=TensorProto.FLOAT)
    return nodes
