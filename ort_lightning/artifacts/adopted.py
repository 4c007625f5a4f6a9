"""Read a folder that ONNX Runtime's ``generate_artifacts`` wrote (no ``ort_lightning.json``) into a `Manifest`.

The manifest is read from the graphs and checkpoint by ORT 1.19.2's conventions: input order,
``labels``/``target`` names, the loss first among outputs, the optimizer node, ``requires_grad``
(or, for a nominal checkpoint, which gradient buffers the training graph takes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx

from ort_lightning.artifacts.manifest import Manifest, TensorSpec
from ort_lightning.artifacts.schedule import graph_schedule
from ort_lightning.errors import ArtifactError
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.graph_files import GRAD_OUT, load_graph, ort_inputs, trained_parameters

__all__ = ["CHECKPOINTS", "GRAPHS", "adopted_files", "adopted_manifest", "locate_prefix", "present_files"]

#: The graphs of a folder, by role; each is ``<prefix><role>.onnx`` or ``<prefix><role>.ort``.
GRAPHS = ("training_model", "eval_model", "optimizer_model")
#: The checkpoints of a folder: the weights, and ORT's weightless one that a device ships (names and shapes).
CHECKPOINTS = ("checkpoint", "nominal_checkpoint")
#: Label input names that ORT's built-in losses add, and the loss each stands for.
_BUILTIN_LABELS = {"labels": "cross_entropy", "target": "mse|l1|bce_with_logits"}
#: How onnxblock names the outputs it adds (``onnx::loss::2``); a model that returns its own loss keeps its name.
_BLOCK_OUTPUT = re.compile(r"onnx::\w+::\d+")


def locate_prefix(directory: Path, names: Iterable[str]) -> str:
    """The one ``prefix=`` of the training graphs among `names` (`ArtifactError` for none or several).

    Example::

        >>> locate_prefix(Path("."), ["pre_training_model.onnx", "pre_checkpoint"])
        'pre_'
    """
    prefixes = sorted({name[: -len(suffix)] for name in names
                       for suffix in ("training_model.onnx", "training_model.ort") if name.endswith(suffix)})
    if len(prefixes) == 1:
        return prefixes[0]
    if not prefixes:
        raise ArtifactError(
            f"{directory} holds no training_model.onnx or training_model.ort (with or without a prefix), so it "
            "is not a training artifacts folder; pass the folder that generate_artifacts() or export_artifacts() wrote."
        )
    raise ArtifactError(
        f"{directory} holds training graphs of several prefixes {prefixes}; pass TrainingArtifacts.load(folder, "
        "prefix=...) (the prefix= given to generate_artifacts) to choose one."
    )


def present_files(directory: Path, prefix: str, *, check_formats: bool = True) -> dict[str, Path | None]:
    """A folder's graphs (``.onnx``, else ``.ort``) and checkpoints by role, None where absent.

    Raises:
        ArtifactError: with `check_formats`, for an ``.ort`` graph that does not match its ``.onnx``.
    """
    files: dict[str, Path | None] = {}
    for role in GRAPHS:
        present = [path for path in (directory / f"{prefix}{role}{suffix}" for suffix in (".onnx", ".ort"))
                   if path.is_file()]
        if len(present) == 2 and check_formats:
            _check_formats_agree(*present)
        files[role] = present[0] if present else None
    for role in CHECKPOINTS:
        path = directory / f"{prefix}{role}"
        files[role] = path if path.is_file() else None
    return files


def adopted_files(directory: Path, prefix: str | None = None) -> dict[str, Path | None]:
    """The paths of a ``generate_artifacts`` folder's graphs and checkpoints (`ArtifactError` for missing ones)."""
    if prefix is None:
        prefix = locate_prefix(directory, (path.name for path in directory.iterdir()))
    files = present_files(directory, prefix)
    for role in GRAPHS[:2]:
        if files[role] is None:
            raise ArtifactError(
                f"{directory} has no {prefix}{role}.onnx or {prefix}{role}.ort; copy the whole folder that "
                "generate_artifacts() wrote, or regenerate it."
            )
    if files["checkpoint"] is None and files["nominal_checkpoint"] is None:
        raise ArtifactError(
            f"{directory} has no {prefix}checkpoint (the weights) and no {prefix}nominal_checkpoint (a device's "
            "weightless one); copy a checkpoint that generate_artifacts() wrote beside the graphs."
        )
    return files


def graph_io(path: Path) -> tuple[list[TensorSpec], list[str]]:
    """The inputs and output names of a graph, ``.onnx`` read by onnx, ``.ort`` through ONNX Runtime."""
    if path.suffix == ".ort":
        inputs, outputs = _ort.ort_graph_io(path)
        return [TensorSpec(name, dtype, shape) for name, dtype, shape in inputs], outputs
    graph = load_graph(path, advice="it is damaged or truncated: copy it again from where the artifacts were "
                       "generated, or regenerate them").graph
    specs = list(TensorSpec.of_inputs(graph.input))
    return specs, [info.name for info in graph.output]


def _check_formats_agree(onnx_path: Path, ort_path: Path) -> None:
    """Refuse an ``.ort`` graph that is not the conversion of the ``.onnx`` one beside it (the device would differ)."""
    onnx_io, ort_io = graph_io(onnx_path), graph_io(ort_path)
    if [s.name for s in onnx_io[0]] != [s.name for s in ort_io[0]] or onnx_io[1] != ort_io[1]:
        raise ArtifactError(
            f"{ort_path.name} and {onnx_path.name} disagree: inputs {[s.name for s in ort_io[0]]} vs "
            f"{[s.name for s in onnx_io[0]]}, outputs {ort_io[1]} vs {onnx_io[1]}; the .ort graph is not the "
            "conversion of the .onnx one. Copy both from one generate_artifacts(..., ort_format=True) run, or "
            "delete the stale one."
        )


def adopted_manifest(
    files: dict[str, Path | None], *, labels: Sequence[str] | None = None
) -> Manifest:
    """Derive the `Manifest` of a ``generate_artifacts`` folder from `files` and its checkpoint.

    `labels` names the label inputs where the graph cannot tell (a custom loss block); None reads
    ORT's conventions.

    Raises:
        ArtifactError: when the checkpoint is of another model, `labels` names an absent input, or
            the labels cannot be told apart from the model inputs.
    """
    training = _path(files, "training_model")
    inputs, outputs = graph_io(training)
    checkpoint = files["checkpoint"] or _path(files, "nominal_checkpoint")
    parameters = _checkpoint_parameters(checkpoint, inputs, weightless=files["checkpoint"] is None)
    trainable = tuple(name for name, grad in parameters if grad)
    frozen = tuple(name for name, grad in parameters if not grad)
    _check_same_model(training, inputs, trainable, frozen, checkpoint)
    state = {*trainable, *frozen}
    added = ort_inputs([spec.name for spec in inputs])
    user = [spec for spec in inputs if spec.name not in state and spec.name not in added]
    label_names = _label_names(training, user, labels, own_loss=not _BLOCK_OUTPUT.fullmatch(outputs[0]))
    optimizer = files.get("optimizer_model")
    return Manifest(
        inputs=tuple(spec for spec in user if spec.name not in label_names),
        labels=tuple(spec for spec in user if spec.name in label_names),
        loss=_loss_name(label_names, labels),
        loss_output=outputs[0],
        outputs=tuple(name for name in outputs[1:] if not name.endswith(GRAD_OUT)),
        optimizer="none" if optimizer is None else _ort.optimizer_kind_in(optimizer),
        optimizer_options={} if optimizer is None else optimizer_attributes(optimizer),
        trainable=trainable,
        frozen=frozen,
        buffers=(),
        lr_schedule=None if optimizer is None else graph_schedule(optimizer),
    )

def optimizer_attributes(path: Path) -> dict[str, float | int]:
    """The hyper-parameters of an optimizer graph's node, as ORT runs them (``.onnx`` or ``.ort`` graph)."""
    kinds = tuple(_ort.OPTIMIZER_NODES)
    if path.suffix == ".ort":
        values = _ort.ort_node_attributes(path, kinds)
    else:
        node = next((n for n in onnx.load(path, load_external_data=False).graph.node if n.op_type in kinds), None)
        values = {} if node is None else {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    # NOTE: float attributes are float32; 7 digits print 0.9, not 0.8999999761581421.
    return {name: float(f"{v:.7g}") if isinstance(v, float) else v for name, v in values.items()}


def _path(files: dict[str, Path | None], role: str) -> Path:
    path = files[role]
    assert path is not None, role  # adopted_files always finds the training graph and a checkpoint
    return path


def _checkpoint_parameters(path: Path, inputs: list[TensorSpec], *, weightless: bool) -> list[tuple[str, bool]]:
    """``(name, requires_grad)`` per state tensor, in the checkpoint's order.

    NOTE: ORT 1.19.2 reads nothing but names of a nominal checkpoint; a name trains when the training
    graph takes its gradient buffer.
    """
    if not weightless:
        summary = _ort_checkpoint(path)[0]
        _check_shapes(path, inputs, summary)
        return [(name, grad) for name, _, grad in summary]
    trained = trained_parameters([spec.name for spec in inputs])
    return [(name, name in trained) for name in _nominal_names(path)]


def _check_shapes(path: Path, inputs: list[TensorSpec], summary: list[tuple[str, tuple[int, ...], bool]]) -> None:
    """Refuse a checkpoint whose tensors have other shapes than the training graph takes (another model's)."""
    graph = {spec.name: spec.shape for spec in inputs}
    for name, shape, _ in summary:
        expected = graph.get(name)
        if expected is not None and len(expected) == len(shape) and all(
            isinstance(want, str) or want == have for want, have in zip(expected, shape, strict=True)
        ):
            continue
        if expected is not None:
            raise ArtifactError(
                f"The checkpoint {path} holds {name} of shape {list(shape)}, but the training graph takes {name} of "
                f"shape {list(expected)}: the checkpoint belongs to another model with the same parameter names. Use "
                "the checkpoint generated with these graphs."
            )


def _nominal_names(path: Path) -> list[str]:
    try:
        nominal = _ort.nominal_summary(path)
    except _ort.CHECKPOINT_READ_ERRORS as error:
        raise ArtifactError(
            f"ONNX Runtime cannot read the nominal checkpoint {path} ({' '.join(str(error).split())[:160]}); copy it "
            "again from where the artifacts were generated, or regenerate them."
        ) from error
    if nominal is None:
        raise ArtifactError(
            f"{path} holds weights, but a nominal checkpoint holds names and shapes only; rename it to "
            f"{path.name[: -len('nominal_checkpoint')]}checkpoint (it is the complete checkpoint), or copy the "
            "nominal checkpoint that generate_artifacts(..., nominal_checkpoint=True) wrote."
        )
    return nominal[0]


def _ort_checkpoint(path: Path) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, object]]:
    try:
        return _ort.checkpoint_summary(path)
    except _ort.CHECKPOINT_READ_ERRORS as error:
        raise ArtifactError(
            f"ONNX Runtime cannot read the checkpoint {path} ({' '.join(str(error).split())[:160]}); if it is a "
            "nominal checkpoint (no weights), pass the complete checkpoint generate_artifacts() wrote; otherwise copy "
            "it again or regenerate the artifacts."
        ) from error


def _check_same_model(
    training: Path, inputs: list[TensorSpec], trainable: tuple[str, ...], frozen: tuple[str, ...], checkpoint: Path
) -> None:
    """Refuse a checkpoint whose parameters are not the ones the training graph trains and reads."""
    names = {spec.name for spec in inputs}
    graph_trainable = trained_parameters(names)
    missing = sorted((set(trainable) ^ graph_trainable) | (set(frozen) - names))
    if missing:
        raise ArtifactError(
            f"The checkpoint {checkpoint} does not fit {training.name}: the graph trains {sorted(graph_trainable)}, "
            f"the checkpoint holds trainable {sorted(trainable)} and frozen {sorted(frozen)} (mismatched: {missing}); "
            "it belongs to another model. Use the checkpoint generated with these graphs."
        )


def _label_names(
    training: Path, user: list[TensorSpec], labels: Sequence[str] | None, *, own_loss: bool
) -> tuple[str, ...]:
    """The label inputs: as named, else ORT's ``labels``/``target``, else none for a model that returns its loss."""
    names = [spec.name for spec in user]
    if labels is not None:
        unknown = [name for name in labels if name not in names]
        if unknown:
            raise ArtifactError(
                f"labels={list(labels)} names {unknown}, but {training.name} takes the inputs {names}; pass labels= "
                "with names among those inputs."
            )
        if list(labels) != names[len(names) - len(labels):]:
            raise ArtifactError(
                f"labels={list(labels)}, but {training.name} takes the inputs {names}, and labels come after the "
                f"model inputs; pass the last inputs as labels= (e.g. labels={names[-len(labels):]})."
            )
        return tuple(labels)
    builtin = [name for name in names if name in _BUILTIN_LABELS]
    if builtin or own_loss or len(names) <= 1:
        return tuple(builtin)
    raise ArtifactError(
        f"{training.name} takes the inputs {names}, and the graph cannot tell which are labels (no 'labels' or "
        "'target' input, as ORT's built-in losses name them: a custom loss block); pass "
        f"ORTLightningModule(folder, labels=[...]) (e.g. labels={names[-1:]}), or labels=[] when the model "
        "computes its loss from inputs alone."
    )


def _loss_name(label_names: tuple[str, ...], labels: Sequence[str] | None) -> str:
    if labels is not None:
        return "custom" if label_names else "model"
    if not label_names:
        return "model"
    return _BUILTIN_LABELS[label_names[0]]
