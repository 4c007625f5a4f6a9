"""Trained values out as the folders transformers and peft read, through their own ``save_pretrained``.

A peft model writes its active adapter's folder, a transformers model ``model.safetensors`` +
``config.json``; with ``merge=True`` a peft model is merged first. The folder is written as a whole.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ort_lightning.errors import ConfigurationError
from ort_lightning.pretrained.rebuild import load_values, rebuild
from ort_lightning.pretrained.record import read_record
from ort_lightning.storage.staging import staged_folder

__all__ = ["write_pretrained"]


def write_pretrained(
    values: Mapping[str, torch.Tensor],
    folder: str | os.PathLike[str],
    *,
    artifacts: Path,
    model: torch.nn.Module | None = None,
    merge: bool = False,
    source: str,
) -> Path:
    """Write `values` as the exported model's ``save_pretrained`` folder; return the folder.

    Args:
        values: name -> tensor of ORT's state (``named_parameters()`` names; a tied weight once).
        folder: where the model writes itself; created if missing, its files replaced.
        artifacts: the artifacts folder whose record rebuilds the model (unless `model` is given).
        model: the torch model to write instead of the record's rebuild.
        merge: merge peft adapters into the base weights and write the merged model.
        source: what the values come from, for the messages.

    Raises:
        ArtifactError: when `model` is None and the artifacts record no transformers model.
        CheckpointError: when `values` do not fit the model.
        ConfigurationError: for a `model` that has no ``save_pretrained``.
    """
    if model is None:
        model = rebuild(read_record(artifacts))
    elif not callable(getattr(model, "save_pretrained", None)):
        raise ConfigurationError(
            f"Expected `model` to be a transformers PreTrainedModel or a peft PeftModel (something with "
            f"save_pretrained), but got {type(model).__name__}; pass the model the artifacts were exported from, or "
            "leave model= out for artifacts exported from a transformers model."
        )
    load_values(model, values, source=source)
    written: Any = _merged(model) if merge else model
    # NOTE: a peft model writes its active adapter, the one trained: ORT's state holds no other adapter's values.
    # (PeftModel.active_adapters is a list; transformers' own active_adapters is a method.)
    active = getattr(written, "active_adapters", None)
    options = {"selected_adapters": list(active)} if isinstance(active, list) else {}
    with staged_folder(folder, needed=None) as stage:
        written.save_pretrained(stage, **options)
    return Path(folder)


def _merged(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its adapters merged into the base weights (a copy; the model itself keeps its adapters)."""
    if not callable(getattr(model, "merge_and_unload", None)):
        return model
    merged: torch.nn.Module = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    return merged
