"""A device folder as every runtime opens it: its files (the same for a page and `OrtDevice`), its batches' order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.on_device import DeviceFiles

__all__ = ["device_files", "ordered"]


def device_files(artifacts: TrainingArtifacts, *, complete: bool = False) -> DeviceFiles:
    """The files a device opens: ``.ort`` graphs where present; the nominal checkpoint if any, unless `complete`.

    Raises:
        ConfigurationError: for a folder without an optimizer graph.
    """
    if artifacts.optimizer_model is None:
        raise ConfigurationError(f"{artifacts.directory} has no optimizer graph, but a device trains with one; "
                                 "export the artifacts with an optimizer (export_artifacts(..., optimizer='adamw')).")

    def fastest(path: Path) -> Path:
        return path.with_suffix(".ort") if path.with_suffix(".ort").is_file() else path

    checkpoint = artifacts.checkpoint if complete else (artifacts.nominal_checkpoint or artifacts.checkpoint)
    return DeviceFiles(training=fastest(artifacts.training_model), optimizer=fastest(artifacts.optimizer_model),
                       checkpoint=checkpoint, eval=fastest(artifacts.eval_model))


def ordered(batch: object, names: Sequence[str]) -> Sequence[Any]:
    """A batch in the training graph's input order (a dict is keyed by input name, a tuple is in order)."""
    if isinstance(batch, Mapping):
        return [batch[name] for name in names]
    return list(batch)  # type: ignore[call-overload]
