"""What ``ort-lightning inspect`` prints: an artifacts folder or an ORT checkpoint file, as aligned rows.

Example::

    >>> print(format_rows([("epoch", "3"), ("global_step", "120")]))
    epoch:       3
    global_step: 120
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ort_lightning.cli.usage import UsageError

__all__ = ["describe", "format_rows", "summary_line"]

Rows = list[tuple[str, str]]


def format_rows(rows: Sequence[tuple[str, str]]) -> str:
    """Align ``key: value`` rows on one column."""
    width = max(len(key) for key, _ in rows) + 2
    return "\n".join(f"{key + ':':<{width}}{value}".rstrip() for key, value in rows)


def describe(path: Path) -> str:
    """Describe an artifacts folder or an ORT checkpoint file.

    Raises:
        FileNotFoundError: when `path` does not exist.
        UsageError: for a Lightning/torch ``.ckpt`` (a zip archive), which inspect does not read.
        ValueError: for a file that is not an ONNX Runtime checkpoint.
    """
    if path.is_dir():
        return format_rows(artifacts_rows(path))
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass an artifacts folder or an ORT checkpoint file.")
    if zipfile.is_zipfile(path):
        raise UsageError(
            f"{path} is a torch/Lightning checkpoint (.ckpt); inspect reads an artifacts folder (from export) or an "
            "ORT checkpoint file (*.ortckpt from ORTCheckpoint, or the artifacts' checkpoint file); load a .ckpt "
            "with torch.load(path, weights_only=True)"
        )
    return format_rows([("checkpoint", str(path)), *checkpoint_rows(path)])


def summary_line(directory: Path) -> str:
    """One line on an artifacts folder: inputs and labels, loss, optimizer, parameters, the verification's status.

    What ``ort-lightning export`` prints; `describe` (``export --report``, ``inspect``) gives every row.
    """
    from ort_lightning import TrainingArtifacts
    from ort_lightning.artifacts.state import state_summary

    artifacts = TrainingArtifacts.load(directory)
    manifest = artifacts.manifest
    tensors = ", ".join(f"{spec.name} {spec.dtype} [{', '.join(map(str, spec.shape))}]"
                        for spec in (*manifest.inputs, *manifest.labels))
    parameters = state_summary(artifacts)
    trainable = sum(math.prod(shape) for _, shape, grad in parameters if grad)
    total = sum(math.prod(shape) for _, shape, _ in parameters)
    verified = str((manifest.verification or {}).get("status", "not verified"))
    return (f"wrote {artifacts.directory}: {tensors}; loss {manifest.loss}; optimizer {manifest.optimizer}; "
            f"{total:,} parameters ({trainable:,} trainable); verification {verified}")


def artifacts_rows(directory: Path) -> Rows:
    """Rows for an artifacts folder: inputs, labels, outputs, loss, optimizer, parameters, versions."""
    from ort_lightning import TrainingArtifacts
    from ort_lightning.export.verify.verifier import report_rows

    artifacts = TrainingArtifacts.load(directory)
    manifest = artifacts.manifest
    adopted = "generate_artifacts folder (no manifest; read from the graphs)"
    source = adopted if artifacts.adopted else "export_artifacts"
    rows: Rows = [("artifacts", str(artifacts.directory)), ("written by", source)]
    rows += device_rows(artifacts)
    for title, specs in (("input", manifest.inputs), ("label", manifest.labels)):
        rows += [(title, f"{spec.name} {spec.dtype} [{', '.join(map(str, spec.shape))}]") for spec in specs]
    rows.append(("outputs", ", ".join(manifest.outputs) or "-"))
    # NOTE: the loss as the user named it at export; the graph's internal output name means nothing to them.
    loss_options = " ".join(f"{key}={value}" for key, value in manifest.loss_options.items())
    rows.append(("loss", f"{manifest.loss} {loss_options}".rstrip()))
    options = " ".join(f"{key}={value}" for key, value in manifest.optimizer_options.items())
    rows.append(("optimizer", f"{manifest.optimizer} {options}".rstrip()))
    rows.append(("learning rate", _learning_rate(manifest)))
    rows += weightless_rows(artifacts) if artifacts.weightless else checkpoint_rows(artifacts.checkpoint)
    rows += [(title, ", ".join(names) or "-") for title, names in _initializer_roles(artifacts)]
    rows += pretrained_rows(artifacts.directory)
    if not artifacts.adopted:  # ORT's generator records neither a verification nor versions
        rows += report_rows(manifest.verification)
        rows.append(("versions", ", ".join(f"{name} {version}" for name, version in manifest.versions.items())))
    return rows


def pretrained_rows(directory: Path) -> Rows:
    """What ``save-pretrained`` rebuilds: the transformers class and the peft adapters the export recorded.

    Example::

        >>> import tempfile
        >>> pretrained_rows(Path(tempfile.mkdtemp()))
        [('pretrained', "- (not a transformers model: save-pretrained needs the model's code)")]
    """
    from ort_lightning.errors import ArtifactError
    from ort_lightning.pretrained.record import read_record

    try:
        record = read_record(directory)
    except ArtifactError:
        return [("pretrained", "- (not a transformers model: save-pretrained needs the model's code)")]
    model = record.model_class.rpartition(".")[2]
    if not record.adapters:
        return [("pretrained", f"{model} (save-pretrained writes its transformers folder)")]
    adapters = ", ".join(f"{name} (active)" if name == record.active_adapter else name for name in record.adapters)
    return [("pretrained", f"{model} with peft adapters {adapters} (save-pretrained writes the active one)")]


def _learning_rate(manifest: Any) -> str:
    """Where the optimizer's rate comes from: computed in its graph (``prepare_for_web``), or fed by the runtime."""
    from ort_lightning.artifacts.schedule import RUNTIME_FED

    if manifest.lr_schedule is not None:
        return str(manifest.lr_schedule.describe())
    return "- (no optimizer graph)" if manifest.optimizer == "none" else RUNTIME_FED


#: What a device running ONNX Runtime's training API loads: ``.ort`` graphs (mobile builds), else ``.onnx``.
_DEVICE_FILES = ("training_model", "eval_model", "optimizer_model")


def device_rows(artifacts: Any) -> Rows:
    """Rows naming each file a device needs, and its size, then what the operator lists are for.

    A device loads the three graphs (``.ort`` preferred) and one checkpoint: the nominal one when the
    folder has it (the weights then come from a server), else the complete one (with ``checkpoint.data``
    beside a large one). Nothing else is listed: the complete checkpoint stays with whoever sends weights.
    """
    folder: Path = artifacts.directory
    name = artifacts.training_model.name
    prefix = name[: name.rindex("training_model")]
    graphs = [_preferred_graph(folder, f"{prefix}{role}") for role in _DEVICE_FILES]
    nominal = folder / f"{prefix}nominal_checkpoint"
    complete = folder / f"{prefix}checkpoint"
    needed = [graph for graph in graphs if graph is not None]
    needed += [nominal] if nominal.is_file() else [complete, folder / f"{complete.name}.data"]
    rows: Rows = [("device file", f"{path.name} ({_size(path)})") for path in needed if path.is_file()]
    return rows + _operator_list_rows(folder, prefix)


def _preferred_graph(folder: Path, stem: str) -> Path | None:
    present = [path for path in (folder / f"{stem}.ort", folder / f"{stem}.onnx") if path.is_file()]
    return present[0] if present else None


def _operator_list_rows(folder: Path, prefix: str) -> Rows:
    """Explain the ``*.required_operators.config`` files ORT's ``.ort`` converter writes, when there are some."""
    configs = sorted(folder.glob(f"{prefix}*.required_operators.config"))
    if not configs:
        return []
    names = ", ".join(path.name for path in configs)
    return [("operator lists", f"{names}: the operators of each .ort graph, from ORT's converter; a device does not "
                               "load them, they configure a reduced-operator ONNX Runtime build for mobile "
                               "(build.py --minimal_build --include_ops_by_config FILE)")]


def _size(path: Path) -> str:
    size = float(path.stat().st_size)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    return f"{size:,.1f} GB"


def _initializer_roles(artifacts: Any) -> list[tuple[str, list[str]]]:
    """Which tensors train, which are frozen or buffers, and which float initializers stay constants."""
    import onnx

    from ort_lightning.export.onnx_nodes import FLOAT_TYPES

    manifest = artifacts.manifest
    state = {*manifest.trainable, *manifest.frozen, *manifest.buffers}
    if artifacts.eval_model.suffix != ".onnx":  # an .ort graph: ONNX Runtime's format, which onnx cannot read
        return [("trains", list(manifest.trainable)), ("frozen", list(manifest.frozen))]
    graph = onnx.load(artifacts.eval_model, load_external_data=False).graph
    constants = sorted(t.name for t in graph.initializer if t.data_type in FLOAT_TYPES and t.name not in state)
    return [("trains", list(manifest.trainable)), ("frozen", list(manifest.frozen)),
            ("buffers", list(manifest.buffers)), ("constants", constants)]


def weightless_rows(artifacts: Any) -> Rows:
    """Rows for a folder without weights (only the nominal checkpoint): the state the graph takes, and no weights."""
    from ort_lightning.artifacts.state import state_summary

    parameters = state_summary(artifacts)
    trainable = sum(math.prod(shape) for _, shape, grad in parameters if grad)
    total = sum(math.prod(shape) for _, shape, _ in parameters)
    return [
        ("parameters", f"{total:,} values in {len(parameters)} tensors ({trainable:,} trainable)"),
        ("weights", f"none in this folder ({artifacts.nominal_checkpoint.name} only: names and shapes); train it with "
                    "ORTLightningModule(folder, values={name: tensor}), the weights a server sends"),
    ]


def checkpoint_rows(path: Path) -> Rows:
    """Rows for an ORT checkpoint file: parameter counts and the stored properties, explained."""
    from ort_lightning.ort import runtime as _ort
    from ort_lightning.storage.atomic import verify_digest

    verify_digest(path)  # a sidecar written by ORTCheckpoint guards against silent corruption
    try:
        parameters, properties = _ort.checkpoint_summary(path)
    except _ort.CHECKPOINT_READ_ERRORS as error:
        raise ValueError(
            f"{path} is not an ONNX Runtime checkpoint; inspect reads an artifacts folder or an ORT checkpoint "
            "file (*.ortckpt from ORTCheckpoint, or the artifacts' checkpoint file)."
        ) from error
    trainable = sum(math.prod(shape) for _, shape, grad in parameters if grad)
    total = sum(math.prod(shape) for _, shape, _ in parameters)
    rows: Rows = [("parameters", f"{total:,} values in {len(parameters)} tensors ({trainable:,} trainable)")]
    return rows + [(name, _explain(name, value)) for name, value in sorted(properties.items())]


def _explain(name: str, value: Any) -> str:
    if name == "epoch":
        return f"{value} (0-based, as Lightning counts; epoch {int(value) + 1} counting from 1)"
    if name == "lr":
        note = ", the schedule has ended" if float(value) == 0.0 else ""
        return f"{value:g} (for the next optimizer step{note})"
    return str(value)
