"""What the files of an artifacts folder must agree on, checked once when the folder is loaded.

Each graph must be the graph of its slot, the manifest what the graphs say, and the checkpoint the
one exported (its sha256). ``.ort`` graphs, which onnx cannot read, are checked by ORT itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ort_lightning.artifacts.manifest import MANIFEST_NAME, Manifest, TensorSpec
from ort_lightning.errors import ArtifactError
from ort_lightning.ort import limits
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.graph_files import GRAD_OUT, RESET, load_graph, ort_inputs, trained_parameters
from ort_lightning.storage.atomic import sha256_of

if TYPE_CHECKING:
    import onnx

__all__ = ["GraphFacts", "check_checkpoint_digest", "check_graphs", "check_manifest", "checkpoint_digest",
           "read_graph", "remember_graph"]

#: Label element types per loss kind: class indices, or values like the model's output.
_CLASS_LOSSES = ("cross_entropy", "nll")
_VALUE_LOSSES = ("mse", "l1", "bce_with_logits", "smooth_l1", "huber", "mse|l1|bce_with_logits")
_ADVICE = "re-export the artifacts with export_artifacts(), or copy the whole folder again from where it was exported"


@dataclass(frozen=True)
class GraphFacts:
    """What one read of an ``.onnx`` graph tells: its inputs, outputs and node types, and the slot they fit."""

    path: Path
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    op_types: frozenset[str]
    #: Each output's static dimensions, in `outputs`' order (0 for a symbolic or unknown one).
    output_dims: tuple[tuple[int, ...], ...] = ()

    @property
    def role(self) -> str:
        """``"training_model"``, ``"eval_model"`` or ``"optimizer_model"``: the slot this graph's content fits."""
        if self.op_types & set(_ort.OPTIMIZER_NODES):
            return "optimizer_model"
        if any(spec.name == RESET for spec in self.inputs):
            return "training_model"
        return "eval_model"

    @property
    def trained(self) -> set[str]:
        """The parameters whose gradient buffers the graph takes (a training graph's trainable set)."""
        return trained_parameters([spec.name for spec in self.inputs])


def read_graph(path: Path) -> GraphFacts:
    """Read an ``.onnx`` graph once (cached by size and mtime); its IR version checked, its facts returned.

    Raises:
        ArtifactError: for a file onnx cannot parse, or an IR version ORT 1.19.2 cannot read.
    """
    stat = path.stat()
    known = _KNOWN.get((path, stat.st_size, stat.st_mtime_ns))
    return known if known is not None else _read_graph(path, stat.st_size, stat.st_mtime_ns)


#: Facts of graphs the export just wrote (`remember_graph`), by path, size and mtime.
_KNOWN: dict[tuple[Path, int, int], GraphFacts] = {}
#: How many graphs' facts `_KNOWN` keeps: the last few exports' graphs.
_KNOWN_LIMIT = 32


def remember_graph(path: Path, model: onnx.ModelProto) -> None:
    """Keep the facts of `model`, just saved at `path`, so that `read_graph` need not read the file back."""
    stat = path.stat()
    while len(_KNOWN) >= _KNOWN_LIMIT:
        # The oldest go first: clearing them all could drop the graphs of the export in progress.
        del _KNOWN[next(iter(_KNOWN))]
    _KNOWN[(path, stat.st_size, stat.st_mtime_ns)] = _facts_of(path, model)


@functools.lru_cache(maxsize=32)
def _read_graph(path: Path, size: int, mtime_ns: int) -> GraphFacts:
    return _facts_of(path, load_graph(path, advice=f"it is damaged or truncated: {_ADVICE}"))


def _facts_of(path: Path, model: onnx.ModelProto) -> GraphFacts:
    if model.ir_version > limits.MAX_IR_VERSION:
        raise ArtifactError(
            f"{path} has ONNX IR version {model.ir_version}, but ONNX Runtime 1.19.2 reads IR <= "
            f"{limits.MAX_IR_VERSION}; re-export with export_artifacts() (it lowers the IR version) or "
            "install onnx==1.17.0 before generating artifacts."
        )
    graph = model.graph
    if not graph.node:
        raise ArtifactError(
            f"{path} holds no graph ({path.stat().st_size} bytes, no nodes): it is empty or truncated; {_ADVICE}."
        )
    inputs = TensorSpec.of_inputs(graph.input)
    dims = tuple(tuple(dim.dim_value for dim in info.type.tensor_type.shape.dim) for info in graph.output)
    return GraphFacts(path, inputs, tuple(info.name for info in graph.output),
                      frozenset(node.op_type for node in graph.node), dims)


def check_graphs(graphs: Mapping[str, GraphFacts]) -> None:
    """Refuse a graph in the wrong slot, or an eval graph whose parameters differ from the training graph's."""
    for role, facts in graphs.items():
        if facts.role != role:
            raise ArtifactError(
                f"{facts.path} holds {_described(facts)}, not the {role.replace('_model', '')} graph its name says "
                f"(files swapped or copied over each other); {_ADVICE}."
            )
    training, evaluation = graphs.get("training_model"), graphs.get("eval_model")
    if training is None or evaluation is None:
        return
    shapes = {spec.name: spec.shape for spec in training.inputs}
    for spec in evaluation.inputs:
        if spec.name in shapes and _conflict(shapes[spec.name], spec.shape):
            raise ArtifactError(
                f"{evaluation.path.name} takes {spec.name} of shape {list(spec.shape)}, but {training.path.name} "
                f"takes {list(shapes[spec.name])}: the two graphs are of different models; {_ADVICE}."
            )


def _conflict(first: tuple[int | str, ...], second: tuple[int | str, ...]) -> bool:
    """Whether two shapes cannot be the same tensor's (symbolic dimensions never conflict)."""
    return len(first) != len(second) or any(
        isinstance(a, int) and isinstance(b, int) and a > 0 and b > 0 and a != b
        for a, b in zip(first, second, strict=True)
    )


def _described(facts: GraphFacts) -> str:
    return {
        "optimizer_model": f"an optimizer update ({', '.join(sorted(facts.op_types & set(_ort.OPTIMIZER_NODES)))})",
        "training_model": "a training graph (it takes lazy_reset_grad and gradient buffers)",
        "eval_model": "no gradients and no optimizer node (an eval or inference graph)",
    }[facts.role]


def check_manifest(manifest: Manifest, graphs: Mapping[str, GraphFacts], folder: Path) -> None:
    """Refuse a manifest whose values are not what the folder's ``.onnx`` graphs say (`ArtifactError`)."""
    source = folder / MANIFEST_NAME
    training = graphs.get("training_model")
    if training is not None:
        _check_inputs(manifest, training, source)
        _check_state(manifest, training, source)
        _check_outputs(manifest, training, source)
    _check_loss(manifest, source)
    optimizer = graphs.get("optimizer_model")
    if optimizer is not None:
        kind = _ort.optimizer_kind_of(sorted(optimizer.op_types))
        if kind != manifest.optimizer:
            raise ArtifactError(
                f"{source} says optimizer={manifest.optimizer!r}, but {optimizer.path.name} runs {kind!r} "
                f"({', '.join(sorted(optimizer.op_types & set(_ort.OPTIMIZER_NODES)))}): the optimizer graph or the "
                f"manifest is of another export; {_ADVICE}."
            )


def _describe(specs: Sequence[TensorSpec]) -> str:
    return "[" + ", ".join(f"{s.name}: {s.dtype}{list(s.shape)}" for s in specs) + "]"


def _check_inputs(manifest: Manifest, training: GraphFacts, source: Path) -> None:
    # NOTE: ORT puts the user inputs first, then the state tensors: the first state tensor ends them.
    state = {*training.trained, *manifest.trainable, *manifest.frozen, *manifest.buffers}
    state |= ort_inputs([spec.name for spec in training.inputs])
    ends = [index for index, spec in enumerate(training.inputs) if spec.name in state]
    actual = list(training.inputs[: ends[0] if ends else len(training.inputs)])
    described = list(manifest.graph_inputs)
    if [(s.name, s.dtype, tuple(s.shape)) for s in described] != [(s.name, s.dtype, tuple(s.shape)) for s in actual]:
        raise ArtifactError(
            f"{source} describes the inputs {_describe(described)}, but {training.path.name} takes "
            f"{_describe(actual)}; the manifest belongs to another model. Re-export the artifacts with "
            "export_artifacts() instead of copying files between folders."
        )


def _check_state(manifest: Manifest, training: GraphFacts, source: Path) -> None:
    """The trainable set is the graph's gradient buffers; trainable, frozen and buffers are its state inputs."""
    trained = training.trained
    if set(manifest.trainable) != trained:
        raise ArtifactError(
            f"{source} lists the trainable parameters {sorted(manifest.trainable)}, but {training.path.name} "
            f"computes gradients for {sorted(trained)}; the manifest is of another export or was edited: {_ADVICE}."
        )
    inputs = {spec.name for spec in training.inputs}
    unknown = sorted(name for name in (*manifest.frozen, *manifest.buffers) if name not in inputs)
    if unknown:
        raise ArtifactError(
            f"{source} lists the frozen parameters or buffers {unknown}, which {training.path.name} does not take; "
            f"the manifest is of another export or was edited: {_ADVICE}."
        )


def _check_outputs(manifest: Manifest, training: GraphFacts, source: Path) -> None:
    outputs = [name for name in training.outputs if not name.endswith(GRAD_OUT)]
    if not outputs or manifest.loss_output != outputs[0] or not set(manifest.outputs) <= set(outputs[1:]):
        raise ArtifactError(
            f"{source} says the loss is {manifest.loss_output!r} and the model outputs {list(manifest.outputs)}, but "
            f"{training.path.name} outputs {outputs} (the loss first); the manifest is of another export or was "
            f"edited: {_ADVICE}."
        )


def _check_loss(manifest: Manifest, source: Path) -> None:
    """Class losses take integer labels, value losses floating-point labels like the model's output."""
    if not manifest.labels:
        return
    label = manifest.labels[0]
    floating = label.dtype.startswith(("float", "bfloat"))
    if (manifest.loss in _CLASS_LOSSES and floating) or (manifest.loss in _VALUE_LOSSES and not floating):
        wanted = "integer class indices" if manifest.loss in _CLASS_LOSSES else "floating-point targets"
        raise ArtifactError(
            f"{source} says loss={manifest.loss!r}, which takes {wanted}, but the graphs take the label "
            f"{label.name!r} as {label.dtype}; the manifest is of another export or was edited: {_ADVICE}."
        )


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_of(Path(path))


def checkpoint_digest(path: Path) -> str:
    """The sha256 of a checkpoint file (cached while the file's size and mtime stay the same)."""
    stat = path.stat()
    return _sha256(os.fspath(path), stat.st_size, stat.st_mtime_ns)


def check_checkpoint_digest(manifest: Manifest, checkpoint: Path | None) -> None:
    """Refuse a complete checkpoint whose sha256 is not the one the manifest recorded (`ArtifactError`)."""
    if manifest.checkpoint_sha256 is None or checkpoint is None:
        return
    found = checkpoint_digest(checkpoint)
    if found != manifest.checkpoint_sha256:
        raise ArtifactError(
            f"{checkpoint} has sha256 {found[:16]}..., but {checkpoint.parent / MANIFEST_NAME} records "
            f"{manifest.checkpoint_sha256[:16]}... for the checkpoint exported with these graphs: the file was damaged "
            f"(flipped or lost bytes) or replaced by another export's, or the manifest is another export's; {_ADVICE}."
        )
