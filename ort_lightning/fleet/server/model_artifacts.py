"""What the ``model`` section names, built: the artifacts folder the fleet trains (exported once)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import export_artifacts
from ort_lightning.fleet.config.fleet_config import FleetConfig, ModelSection
from ort_lightning.fleet.data.sources import import_path
from ort_lightning.fleet.server.lora import check_ffa, freeze_lora_a

__all__ = ["example_inputs", "fleet_artifacts"]

#: Beside the exported folder: the ``model`` section and seed it was exported from.
_RECORD = "fleet_model.json"


def _exported_from(config: FleetConfig) -> dict[str, object]:
    return {"model": dataclasses.asdict(config.model), "seed": config.seed}


def _reuse(folder: Path, config: FleetConfig) -> bool:
    """Whether `folder` holds this config's export; one of another ``model`` section is refused, never reused."""
    if not (folder / "ort_lightning.json").exists():
        return False
    record = folder.parent / _RECORD
    # NOTE: a folder from before the record was written is taken as it is, as it always was.
    if record.exists() and json.loads(record.read_text(encoding="utf-8")) != _exported_from(config):
        raise ConfigurationError(
            f"{folder} was exported from another `model` section or seed ({record} says which); "
            "pass another `output.folder`, or delete that folder to export this model.")
    return True


def fleet_artifacts(config: FleetConfig, example: torch.Tensor | Sequence[torch.Tensor] | None = None, *,
                    search: Sequence[str | os.PathLike[str]] = ()) -> Path:
    """The artifacts folder the fleet trains: the ``model`` section's folder, or its model exported once.

    `example` is the data's first rows, inputs then labels (or one input row, whose shape with a
    batch of 2 is the example input), used when ``model.input_shape`` is null (`example_inputs`).
    The model is built under ``torch.manual_seed(seed)``.
    """
    from ort_lightning.demo import FEATURES, digits_mlp

    model = config.model
    if model.artifacts:
        given = TrainingArtifacts.load(model.artifacts)
        if model.lora == "ffa":
            check_ffa(given)
        return given.directory
    folder = Path(config.output.folder) / "artifacts"
    if _reuse(folder, config):
        return TrainingArtifacts.load(folder).directory
    if model.factory is None:
        module, inputs = digits_mlp(model.hidden, seed=config.seed), torch.zeros(2, FEATURES)
    else:
        torch.manual_seed(config.seed)
        module = import_path(model.factory, key="model.factory", search=search)(**model.init_args)
        inputs = example_inputs(model, example)
    if model.lora == "ffa":
        freeze_lora_a(module)
    exported = export_artifacts(module, inputs, folder, loss=model.loss, nominal_checkpoint=True,
                                verify=model.verify).directory
    (folder.parent / _RECORD).write_text(json.dumps(_exported_from(config), indent=1), encoding="utf-8")
    return exported


def example_inputs(model: ModelSection, example: torch.Tensor | Sequence[torch.Tensor] | None) -> Any:
    """The export's example input: zeros of ``input_shape``, else the data's rows in `example` as they are.

    The rows are the inputs (and the labels too for ``loss: null``), by ``input_names`` when given.

    Raises:
        ConfigurationError: without a shape or rows, or for ``input_names`` that do not name every tensor.
    """
    if model.input_shape is not None:
        return torch.zeros(*model.input_shape)
    if isinstance(example, torch.Tensor):  # one row of the only input
        return torch.zeros(2, *example.shape)
    if example is None:
        raise ConfigurationError("Expected `model.input_shape` (the export's example input, batch first) for "
                                 f"`model.factory` {model.factory}; add e.g. input_shape: [2, 30].")
    tensors = list(example) if model.loss is None else list(example)[:-1]
    if model.input_names is None:
        return tensors[0] if len(tensors) == 1 else tuple(tensors)
    if len(model.input_names) != len(tensors):
        raise ConfigurationError(
            f"Expected `model.input_names` to name the {len(tensors)} tensors the model takes from each batch "
            f"({'inputs and labels' if model.loss is None else 'the inputs'}), but got {model.input_names}; name "
            "each, in the order the data module yields them.")
    return dict(zip(model.input_names, tensors, strict=True))
