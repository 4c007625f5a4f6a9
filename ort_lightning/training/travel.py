"""Lightning ``.ckpt`` files that travel: the artifacts' identity stored, checked, and found again.

A ``.ckpt`` records the artifacts folder as it was typed (often relative) and the ORT state
bytes. Loaded from another folder, or onto artifacts of another model, it used to fail deep in
ONNX Runtime or, for another optimizer kind, not at all. `identity_of` is what the ``.ckpt``
stores (graph digests, parameter names and shapes, optimizer kind); `check_identity` compares
it with the artifacts at hand; `resolve_artifacts` finds a moved folder relative to the
``.ckpt``; `check_metrics` says how to pass ``metrics=`` again (metrics do not pickle into
hyper-parameters).

Example::

    >>> stored = {"optimizer": "adamw", "parameters": [["w", [2], True]], "graphs": {}}
    >>> check_identity(stored, {**stored, "optimizer": "sgd"}, source="Checkpoint run.ckpt", folder="art")
    Traceback (most recent call last):
    ...
    ort_lightning.errors.CheckpointError: Checkpoint run.ckpt does not match the artifacts in art: ...
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ort_lightning.artifacts.state import state_summary
from ort_lightning.errors import CheckpointError
from ort_lightning.ort import runtime as _ort

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = [
    "IDENTITY_KEY", "check_identity", "check_metrics", "hyperparameters_of", "identity_of", "identity_of_state",
    "metric_names",
    "resolve_artifacts",
]

#: Key of the artifacts' identity in a Lightning checkpoint dict.
IDENTITY_KEY = "ort_lightning_artifacts"


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def identity_of(artifacts: TrainingArtifacts) -> dict[str, Any]:
    """The graph digests, parameters ``[name, shape, trainable]`` and optimizer kind of `artifacts`."""
    graphs = {}
    for name in ("training_model", "eval_model", "optimizer_model"):
        path: Path = getattr(artifacts, name)
        stat = path.stat()
        graphs[name] = _digest(os.fspath(path), stat.st_size, stat.st_mtime_ns)
    parameters = state_summary(artifacts)
    return {
        "graphs": graphs,
        "parameters": [[name, list(shape), trainable] for name, shape, trainable in parameters],
        "optimizer": artifacts.manifest.optimizer,
    }


def check_identity(stored: Mapping[str, Any], current: Mapping[str, Any], *, source: object, folder: object) -> None:
    """Refuse a ``.ckpt`` whose artifacts (`stored`) are not the ones at hand (`current`).

    Raises:
        CheckpointError: naming what differs and what to pass instead.
    """
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
    graphs = [name for name, digest in stored.get("graphs", {}).items() if current["graphs"].get(name) != digest]
    if graphs and not problems:
        problems.append(f"its graphs {graphs} differ (the artifacts were exported again, or from another model)")
    if problems:
        raise CheckpointError(
            f"{source} does not match the artifacts in {folder}: {'; '.join(problems)}; pass a checkpoint "
            "written while training these artifacts, or the artifacts it came from (load_from_checkpoint(path, "
            "artifacts=folder))."
        )


def resolve_artifacts(checkpoint_path: Any, hparams: Mapping[str, Any]) -> str | None:
    """The artifacts folder of a ``.ckpt``: as stored if it exists, else relative to the ``.ckpt`` or a parent.

    Returns:
        None when the stored folder exists as written (nothing to change), else the folder found.

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
    """Refuse to load a ``.ckpt`` trained with metrics into a module built without them.

    Raises:
        CheckpointError: naming the metrics and how to pass them again.
    """
    if stored and not present:
        listed = ", ".join(f"{name!r}: {kind}(...)" for name, kind in stored.items())
        raise CheckpointError(
            f"{source} was trained with metrics {{{listed}}}, which a checkpoint cannot rebuild; pass "
            f"them again: load_from_checkpoint(path, metrics={{{listed}}})."
        )


def hyperparameters_of(checkpoint_path: Any) -> dict[str, Any]:
    """The hyper-parameters stored in a ``.ckpt`` file or a seekable buffer (empty for a missing file)."""
    seekable = hasattr(checkpoint_path, "read") and hasattr(checkpoint_path, "seek")
    if not seekable and (not isinstance(checkpoint_path, (str, os.PathLike)) or not Path(checkpoint_path).is_file()):
        return {}
    import torch

    start = checkpoint_path.tell() if seekable else 0
    try:
        # NOTE: weights_only: nothing is run to read them; a .ckpt whose hyper-parameters hold arbitrary
        # objects is left to Lightning's own loading (which the caller must then allow with weights_only=False).
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return {}
    finally:
        if seekable:
            checkpoint_path.seek(start)
    hparams = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
    return dict(hparams)


def identity_of_state(path: Path, artifacts: TrainingArtifacts) -> dict[str, Any]:
    """What a ``.ckpt`` without a stored identity still tells: its ORT state's parameters (graphs unknown)."""
    parameters, _ = _ort.checkpoint_summary(path)
    return {
        "graphs": {},
        "parameters": [[name, list(shape), trainable] for name, shape, trainable in parameters],
        "optimizer": artifacts.manifest.optimizer,
    }
