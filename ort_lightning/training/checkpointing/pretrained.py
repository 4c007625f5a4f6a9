"""`save_pretrained`: a trained module, or any checkpoint the package writes, back out as transformers or peft folders.

The trained values are read from a module, an ORT checkpoint file, a Lightning ``.ckpt`` or an
artifacts folder, checked as a resume checks them, and written through the model's own
``save_pretrained`` (`ort_lightning.pretrained.writer`). docs/guide/huggingface.md shows it end to end.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import CheckpointError, ConfigurationError
from ort_lightning.pretrained.writer import write_pretrained
from ort_lightning.training.checkpointing.checkpoint_files import (
    ORT_STATE_KEY,
    PROGRESS_KEY,
    read_checkpoint_state,
    restored_state,
)
from ort_lightning.training.checkpointing.connector import STATE_DIGEST_KEY
from ort_lightning.training.checkpointing.travel import (
    IDENTITY_KEY,
    check_identity,
    hyperparameters_of,
    identity_of,
    read_lightning_checkpoint,
    resolve_artifacts,
)
from ort_lightning.training.session.session_views import state_values

__all__ = ["save_pretrained", "trained_values"]

Artifacts = TrainingArtifacts | str | os.PathLike[str]


def save_pretrained(
    source: Any,
    folder: str | os.PathLike[str],
    *,
    artifacts: Artifacts | None = None,
    model: torch.nn.Module | None = None,
    merge: bool = False,
) -> Path:
    """Write a trained model as the folder transformers or peft loads, through the model's own ``save_pretrained``.

    A peft model writes its active adapter's folder (``PeftModel.from_pretrained(base, folder)``), a
    transformers model ``model.safetensors`` + ``config.json``; the model is rebuilt from what the
    export recorded (no download), then given the trained values.

    Args:
        source: an `ORTLightningModule`, an ORT checkpoint file, a Lightning ``.ckpt`` an
            `ORTLightningModule` saved, or an artifacts folder (its exported weights).
        folder: where the model writes itself, as a whole (a failure leaves it as it was).
        artifacts: the artifacts folder an ORT checkpoint file was trained on (a ``.ckpt`` names its own).
        model: the torch model the artifacts came from, for artifacts that record no transformers model.
        merge: merge the peft adapters into the base weights and write the merged model.

    Returns:
        The folder.

    Raises:
        ArtifactError: for artifacts that record no transformers model (pass `model`) or do not validate.
        CheckpointError: for a nominal, damaged or foreign checkpoint, or values that do not fit.
        ConfigurationError: for a `source` of another kind, an ORT checkpoint file without `artifacts`,
            or a `model` without ``save_pretrained``.
    """
    values, found, described = trained_values(source, artifacts=artifacts)
    return write_pretrained(values, folder, artifacts=found.directory, model=model, merge=merge, source=described)


def trained_values(
    source: Any, *, artifacts: Artifacts | None = None
) -> tuple[dict[str, torch.Tensor], TrainingArtifacts, str]:
    """ORT's state held by `source` (name -> tensor), the artifacts it belongs to, and `source` in words."""
    held = getattr(source, "artifacts", None)
    if isinstance(source, torch.nn.Module) and isinstance(held, TrainingArtifacts):
        if artifacts is not None:
            raise ConfigurationError(
                "artifacts= names the folder a checkpoint file was trained on, but the source is a module, which "
                f"trains {held.directory} already; leave artifacts= out."
            )
        return state_values(source, held), held, f"The state of {type(source).__name__}"
    if not isinstance(source, str | os.PathLike) or not Path(source).exists():
        raise ConfigurationError(
            f"Expected the source to be an ORTLightningModule or the path of an ORT checkpoint file, a Lightning "
            f".ckpt or an artifacts folder, but got {_shown(source)}; pass the trained module or an existing file."
        )
    path = Path(source)
    if path.is_dir():  # NOTE: an artifacts folder (a generate_artifacts one too); another folder is refused by load
        exported = TrainingArtifacts.load(path)
        return _file_values(exported.checkpoint, exported), exported, f"The checkpoint of {path}"
    if zipfile.is_zipfile(path):
        return _lightning_values(path, artifacts)
    if artifacts is None:
        raise ConfigurationError(
            f"{path} is an ORT checkpoint file, which does not name the artifacts it was trained on; pass them: "
            "save_pretrained(checkpoint, folder, artifacts=<the artifacts folder>) (--artifacts on the command line)."
        )
    loaded = _load(artifacts)
    return _file_values(path, loaded), loaded, f"Checkpoint {path}"


def _shown(source: object) -> str:
    return repr(os.fspath(source)) if isinstance(source, str | os.PathLike) else type(source).__name__


def _load(artifacts: Artifacts) -> TrainingArtifacts:
    return artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts)


def _file_values(path: Path, artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """The values of an ORT checkpoint file, checked against `artifacts` as a resume checks them."""
    _, held = read_checkpoint_state(path, artifacts, weights_given=True)
    if held.nominal_summary() is not None:
        raise CheckpointError(
            f"Checkpoint {path} is a nominal checkpoint (names and shapes, no weights), so there are no trained values "
            "to write back; pass a complete checkpoint: an ORTCheckpoint file, a .ckpt, or the module itself."
        )
    return {name: torch.from_numpy(value) for name, value in held.values().items()}


def _lightning_values(
    path: Path, artifacts: Artifacts | None
) -> tuple[dict[str, torch.Tensor], TrainingArtifacts, str]:
    """The ORT state a Lightning ``.ckpt`` carries, checked as ``on_load_checkpoint`` checks it."""
    checkpoint = read_lightning_checkpoint(path)
    source = f"Checkpoint {path}"
    state = None if checkpoint is None else checkpoint.get(ORT_STATE_KEY)
    if checkpoint is None or state is None:
        raise CheckpointError(
            f"{source} holds no ORT state (no {ORT_STATE_KEY!r} entry read with torch.load(weights_only=True)), so "
            "there are no trained values to write back; pass a .ckpt that an ORTLightningModule saved."
        )
    hparams = hyperparameters_of(checkpoint)
    if artifacts is None:
        artifacts = resolve_artifacts(path, hparams) or hparams.get("artifacts")
    if artifacts is None:
        raise CheckpointError(f"{source} names no artifacts folder; pass artifacts=<the folder it was trained on>.")
    loaded = _load(artifacts)
    stored = checkpoint.get(IDENTITY_KEY)
    if stored is not None:
        check_identity(stored, identity_of(loaded), source=source, folder=loaded.directory)
    progress: Mapping[str, Any] = checkpoint.get(PROGRESS_KEY) or {}
    with restored_state(state, digest=progress.get(STATE_DIGEST_KEY)) as file:
        return _file_values(file, loaded), loaded, source
