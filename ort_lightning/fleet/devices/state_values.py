"""The values a fleet exchanges: every tensor of ORT's state, in the training graph's order.

Trainable and frozen parameters and buffers (BatchNorm's statistics), in the `WeightOrder`. Setting
values copies them into the torch views of ORT's memory in place: no ORT object is rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.weight_order import WeightOrder

if TYPE_CHECKING:
    from ort_lightning.training.module import ORTLightningModule

__all__ = ["get_values", "set_values", "state_tensors"]


def state_tensors(module: torch.nn.Module, artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """The module's views of ORT's state tensors, keyed by name, in the `WeightOrder`.

    Raises:
        ConfigurationError: when the module lacks a tensor the training graph takes.
    """
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    order = WeightOrder.of(artifacts).names
    missing = [name for name in order if name not in tensors]
    if missing:
        raise ConfigurationError(
            f"The training graph of {artifacts.directory} takes state tensors {missing} that the module does not "
            "have; build the module from these artifacts (ORTLightningModule(artifacts))."
        )
    return {name: tensors[name] for name in order}


def get_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the values of ORT's state of an `ORTLightningModule`, keyed by name, in the `WeightOrder`."""
    artifacts: TrainingArtifacts = module.artifacts  # type: ignore[assignment]
    return {name: tensor.detach().cpu().clone() for name, tensor in state_tensors(module, artifacts).items()}


def set_values(module: ORTLightningModule, values: Mapping[str, object]) -> None:
    """Copy `values` into ORT's state in place (no ORT object is rebuilt): `ORTLightningModule.set_values`.

    The module's optimizer state and progress stay as they are; `values` hold every state tensor.

    Raises:
        ConfigurationError: for missing, unexpected or misshapen values.
    """
    module.set_values(values)
