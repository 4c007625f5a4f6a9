"""Lightning ``.ckpt`` files that travel: the artifacts' identity stored, checked, and found again.

A ``.ckpt`` stores the artifacts' identity (`identity_of`: graph digests, parameters, optimizer
kind), checked on load (`check_identity`); a moved folder is found beside the ``.ckpt``
(`resolve_artifacts`); `check_metrics` says how to pass ``metrics=`` again.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ort_lightning.artifacts.checks import checkpoint_digest
from ort_lightning.artifacts.state import state_summary
from ort_lightning.errors import CheckpointError
from ort_lightning.ort import runtime as _ort

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = [
    "IDENTITY_KEY", "check_identity", "check_metrics", "hyperparameters_of", "identity_of", "identity_of_state",
    "metric_names",
    "read_lightning_checkpoint",
    "resolve_artifacts",
]

#: Key of the artifacts' identity in a Lightning checkpoint dict.
IDENTITY_KEY = "ort_lightning_artifacts"


def identity_of(artifacts: TrainingArtifacts) -> dict[str, Any]:
    """The graph digests (by role and by file), parameters ``[name, shape, trainable]`` and optimizer kind."""
    graphs, files = {}, {}
    for name in ("training_model", "eval_model", "optimizer_model"):
        path: Path | None = getattr(artifacts, name)
        if path is None:
            continue
        graphs[name] = checkpoint_digest(path)
        for twin in (path.with_suffix(".onnx"), path.with_suffix(".ort")):
            if twin.is_file():
                files[twin.name] = checkpoint_digest(twin)
    parameters = state_summary(artifacts)
    return {
        "graphs": graphs,
        "graph_files": files,
        "parameters": [[name, list(shape), trainable] for name, shape, trainable in parameters],
        "optimizer": artifacts.manifest.optimizer,
    }


def _differing_graphs(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The graphs whose digests differ: by file name when both sides list files (formats apart), else by role."""
    stored_files = stored.get("graph_files")
    if stored_files is not None:
        current_files = current["graph_files"]
        common = set(stored_files) & set(current_files)
        return sorted(name for name in common if stored_files[name] != current_files[name])
    # NOTE: a .ckpt written before graph_files: its digests are of whatever format its folder trained with.
    return [name for name, digest in stored.get("graphs", {}).items() if current["graphs"].get(name) != digest]


def _check_record(stored: object, *, source: object) -> None:
    """Refuse an identity record whose fields have the wrong types (a damaged or hand-made ``.ckpt``)."""
    parameters = stored.get("parameters", []) if isinstance(stored, Mapping) else None
    valid = (
        isinstance(stored, Mapping)
        and isinstance(parameters, list)
        and all(isinstance(p, list | tuple) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[1], list | tuple)
                and all(isinstance(dim, int) for dim in p[1]) and isinstance(p[2], bool) for p in parameters)
        and isinstance(stored.get("optimizer", ""), str)
        and all(isinstance(stored.get(key, {}), Mapping) for key in ("graphs", "graph_files", "metrics"))
    )
    if not valid:
        raise CheckpointError(
            f"{source} holds a damaged record of its artifacts under {IDENTITY_KEY!r} (expected graph digests, "
            f"parameters [name, shape, trainable] and the optimizer kind, got {str(stored)[:120]}); it was not written "
            "by ORTLightningModule or it was edited: pass another checkpoint of these artifacts."
        )


def check_identity(stored: Mapping[str, Any], current: Mapping[str, Any], *, source: object, folder: object) -> None:
    """Refuse a ``.ckpt`` whose artifacts (`stored`) are not the ones at hand (`current`).

    Example::

        >>> stored = {"optimizer": "adamw", "parameters": [["w", [2], True]], "graphs": {}}
        >>> check_identity(stored, {**stored, "optimizer": "sgd"}, source="Checkpoint run.ckpt", folder="art")
        Traceback (most recent call last):
        ...
        ort_lightning.errors.CheckpointError: Checkpoint run.ckpt does not match the artifacts in art: ...
    """
    _check_record(stored, source=source)
    problems = []
    have = {name: (list(shape), grad) for name, shape, grad in stored.get("parameters", [])}
    want = {name: (list(shape), grad) for name, shape, grad in current["parameters"]}
    if have != want:
        differ = sorted(name for name in set(have) & set(want) if have[name] != want[name])
        problems.append(
            f"its parameters are missing {sorted(set(want) - set(have))}, unexpected {sorted(set(have) - set(want))}, "
            f"different {[f'{n}: {have[n][0]} vs {want[n][0]}' for n in differ]}"
        )
    if stored.get("optimizer") != current["optimizer"]:
        problems.append(f"its optimizer is {stored.get('optimizer')!r}, the artifacts' is {current['optimizer']!r}")
    graphs = _differing_graphs(stored, current)
    if graphs and not problems:
        problems.append(f"its graphs {graphs} differ (the artifacts were exported again, or from another model)")
    if problems:
        raise CheckpointError(
            f"{source} does not match the artifacts in {folder}: {'; '.join(problems)}; pass a checkpoint "
            "written while training these artifacts, or the artifacts it came from (load_from_checkpoint(path, "
            "artifacts=folder))."
        )


def resolve_artifacts(checkpoint_path: Any, hparams: Mapping[str, Any]) -> str | None:
    """A ``.ckpt``'s artifacts folder: None if it exists as stored, else the one found beside it or above.

    Raises:
        CheckpointError: when the folder is found nowhere; the message names ``artifacts=``.
    """
    stored = hparams.get("artifacts")
    if stored is None or Path(stored).is_dir() or not isinstance(checkpoint_path, (str, os.PathLike)):
        return None
    ckpt = Path(checkpoint_path).resolve()
    relative = Path(stored)
    for parent in ckpt.parents:
        for candidate in (parent / relative, parent / relative.name):
            if (candidate / "ort_lightning.json").is_file():
                return os.fspath(candidate)
    raise CheckpointError(
        f"Checkpoint {checkpoint_path} was trained on the artifacts folder {stored!r}, which exists neither as "
        "written nor beside the checkpoint or in one of its parent folders; pass "
        f"load_from_checkpoint({os.fspath(checkpoint_path)!r}, artifacts=<that folder>)."
    )


def metric_names(metrics: Mapping[str, Any]) -> dict[str, str]:
    """Name -> class name of each training metric, what a ``.ckpt`` records of ``metrics=``."""
    collection = metrics.get("train")
    if collection is None:
        return {}
    return {name: type(metric).__name__ for name, metric in collection.items(keep_base=True)}


def check_metrics(stored: Mapping[str, str], present: bool, *, source: object) -> None:
    """Refuse to load a ``.ckpt`` trained with metrics into a module built without them."""
    if stored and not present:
        listed = ", ".join(f"{name!r}: {kind}(...)" for name, kind in stored.items())
        raise CheckpointError(
            f"{source} was trained with metrics {{{listed}}}, which a checkpoint cannot rebuild; pass "
            f"them again: load_from_checkpoint(path, metrics={{{listed}}})."
        )


def read_lightning_checkpoint(checkpoint_path: Any) -> dict[str, Any] | None:
    """The dict a ``.ckpt`` holds (``weights_only=True``), or None where Lightning should tell.

    Raises:
        CheckpointError: for a file that is not a ``.ckpt`` torch wrote, or holds no dict.
    """
    if hasattr(checkpoint_path, "read") and hasattr(checkpoint_path, "seek"):
        return _read_buffer(checkpoint_path)
    if not isinstance(checkpoint_path, (str, os.PathLike)) or not Path(checkpoint_path).is_file():
        return None
    import torch

    path = os.fspath(checkpoint_path)
    # NOTE: torch.save writes a zip archive; a truncated one has lost its central directory at the end.
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a checkpoint torch.save wrote ({Path(path).stat().st_size} bytes, no zip archive): it is "
            "truncated, empty or another file; pass another .ckpt (an earlier one, or last.ckpt)."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return None  # NOTE: hyper-parameters that hold objects: Lightning's own loading decides
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as error:
        raise CheckpointError(
            f"{path} cannot be read by torch.load ({' '.join(str(error).split())[:160]}): it is damaged; pass another "
            ".ckpt (an earlier one, or last.ckpt)."
        ) from error
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"{path} holds a {type(checkpoint).__name__}, but a Lightning checkpoint is a dict (state_dict, "
            "hyper_parameters, ...); pass a .ckpt that Trainer.save_checkpoint or ModelCheckpoint wrote."
        )
    return checkpoint


def _read_buffer(buffer: Any) -> dict[str, Any] | None:
    """The dict a seekable buffer holds (``torch.load(weights_only=True)``), left at its start; None if unreadable."""
    import torch

    start = buffer.tell()
    try:
        # NOTE: weights_only: nothing is run to read it; what torch cannot read this way is Lightning's to report.
        checkpoint = torch.load(buffer, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError):
        return None
    finally:
        buffer.seek(start)
    return checkpoint if isinstance(checkpoint, dict) else None


def hyperparameters_of(checkpoint: dict[str, Any] | None) -> dict[str, Any]:
    """The hyper-parameters stored in a ``.ckpt`` that `read_lightning_checkpoint` read (empty for None)."""
    hparams = checkpoint.get("hyper_parameters", {}) if checkpoint is not None else {}
    return dict(hparams) if isinstance(hparams, Mapping) else {}


def identity_of_state(path: Path, artifacts: TrainingArtifacts) -> dict[str, Any]:
    """What a ``.ckpt`` without a stored identity still tells: its ORT state's parameters (graphs unknown)."""
    parameters, _ = _ort.checkpoint_summary(path)
    return {
        "graphs": {},
        "parameters": [[name, list(shape), trainable] for name, shape, trainable in parameters],
        "optimizer": artifacts.manifest.optimizer,
    }
