"""Passes over the graphs that ONNX Runtime generated: each file loaded once, fixed, saved once.

`finish` runs, per graph and in order:

- ``training_model.onnx``: BatchNorm running statistics updated by torch's rule
  (`batchnorm.torch_running_statistics`), then the IR version ORT reads;
- ``eval_model.onnx``: the training-only outputs trimmed and Dropout made an Identity
  (`fix_eval_graph`), then the IR version;
- ``optimizer_model.onnx``: torch's decoupled AdamW weight decay (`set_torch_adamw_mode`, AdamW
  only), then the IR version.

It returns the finished training graph, so that the manifest reads its inputs and outputs
without loading the file again.

Example::

    >>> import onnx
    >>> graph = onnx.helper.make_graph([onnx.helper.make_node("Dropout", ["x"], ["y", "mask"])], "g", [], [])
    >>> model = onnx.helper.make_model(graph)
    >>> fix_eval_graph(model)
    >>> [(n.op_type, list(n.output)) for n in model.graph.node]
    [('Identity', ['y'])]
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
    """Apply the passes after generation to the graph files in `paths`; return the training graph.

    Args:
        paths: ``training_model``, ``eval_model`` and ``optimizer_model`` -> their files.
        optimizer: ``"adamw"`` or ``"sgd"``, as generated.
    """
    return finish_graphs(paths, optimizer=optimizer)["training_model"]


def finish_graphs(paths: dict[str, Path], *, optimizer: str) -> dict[str, onnx.ModelProto]:
    """Apply the passes after generation to the graph files in `paths`; return each graph as saved.

    Args:
        paths: ``training_model``, ``eval_model`` and ``optimizer_model`` -> their files.
        optimizer: ``"adamw"`` or ``"sgd"``, as generated.
    """
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
    """Make an eval graph an inference graph that ORT can load.

    ORT's generator turns training mode off in the eval graph but keeps the training-only
    outputs (running statistics of BatchNormalization, the mask of Dropout), which ORT then
    refuses. Those outputs are trimmed and Dropout becomes an Identity.
    """
    for node in proto.graph.node:
        if node.op_type in _TRAINING_ONLY_OUTPUTS:
            del node.output[1:]
        if node.op_type == "Dropout":
            node.op_type = "Identity"
            del node.input[1:]
            del node.attribute[:]


def set_torch_adamw_mode(proto: onnx.ModelProto) -> None:
    """Switch the AdamW node of an optimizer graph to torch's decoupled weight decay.

    ORT's default ``adam_mode=1`` decays after the update (the Hugging Face variant);
    ``adam_mode=0`` decays before, as ``torch.optim.AdamW`` does.
    """
    for node in proto.graph.node:
        if node.op_type == "AdamWOptimizer":
            for attribute in node.attribute:
                if attribute.name == "adam_mode":
                    attribute.i = 0
