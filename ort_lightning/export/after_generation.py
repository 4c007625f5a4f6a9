"""Passes over the graphs that ONNX Runtime generated: each file loaded once, fixed, saved once.

Training graph: BatchNorm running statistics by torch's rule. Eval graph: training-only outputs
trimmed, Dropout an Identity. Optimizer graph: torch's decoupled AdamW weight decay. Each then
gets the IR version ORT reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import onnx

from ort_lightning.export.batchnorm import torch_running_statistics
from ort_lightning.ort.limits import lower_ir_version

__all__ = ["finish", "finish_graphs", "fix_eval_graph", "set_torch_adamw_mode"]

_TRAINING_ONLY_OUTPUTS = ("BatchNormalization", "Dropout")

Pass = Callable[[onnx.ModelProto], object]


def finish(paths: dict[str, Path], *, optimizer: str) -> onnx.ModelProto:
    """Apply the passes to the graph files in `paths` (role -> file) for `optimizer`; return the training graph."""
    return finish_graphs(paths, optimizer=optimizer)["training_model"]


def finish_graphs(paths: dict[str, Path], *, optimizer: str) -> dict[str, onnx.ModelProto]:
    """Apply the passes to the graph files in `paths` (role -> file) for `optimizer`; return each graph as saved."""
    passes: dict[str, Sequence[Pass]] = {
        "training_model": (torch_running_statistics, lower_ir_version),
        "eval_model": (fix_eval_graph, lower_ir_version),
        "optimizer_model": (set_torch_adamw_mode, lower_ir_version) if optimizer == "adamw" else (lower_ir_version,),
    }
    return {name: _rewrite(paths[name], graph_passes) for name, graph_passes in passes.items()}


def _rewrite(path: Path, passes: Sequence[Pass]) -> onnx.ModelProto:
    """Load `path` once, apply `passes` in order, save it once."""
    proto = onnx.load(path)
    for graph_pass in passes:
        graph_pass(proto)
    onnx.save(proto, path)
    return proto


def fix_eval_graph(proto: onnx.ModelProto) -> None:
    """Make an eval graph an inference graph ORT can load: training-only outputs trimmed, Dropout an Identity.

    Example::

        >>> import onnx
        >>> node = onnx.helper.make_node("Dropout", ["x"], ["y", "m"])
        >>> model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [], []))
        >>> fix_eval_graph(model)
        >>> [(n.op_type, list(n.output)) for n in model.graph.node]
        [('Identity', ['y'])]
    """
    for node in proto.graph.node:
        if node.op_type in _TRAINING_ONLY_OUTPUTS:
            del node.output[1:]
        if node.op_type == "Dropout":
            node.op_type = "Identity"
            del node.input[1:]
            del node.attribute[:]


def set_torch_adamw_mode(proto: onnx.ModelProto) -> None:
    """Switch an optimizer graph's AdamW to torch's decoupled weight decay (``adam_mode=0``)."""
    for node in proto.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0
