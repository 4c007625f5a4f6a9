"""The values of ORT's state a fleet reads and writes, by name, in the training graph's order.

`get_values` and `set_values` take every state tensor (the `WeightOrder`); `sent_values`,
`load_sent` and `whole_values` take the ones that cross the wire (all but the frozen parameters,
see `Exchange`). Setting values copies them into the torch views of ORT's memory in place.
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

__all__ = ["get_values", "load_sent", "sent_values", "set_values", "state_tensors", "whole_values"]


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


def sent_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the values a fleet sends: `get_values` without the frozen parameters."""
    artifacts: TrainingArtifacts = module.artifacts  # type: ignore[assignment]
    frozen = set(artifacts.manifest.frozen)
    return {name: tensor.detach().cpu().clone() for name, tensor in state_tensors(module, artifacts).items()
            if name not in frozen}


@torch.no_grad()
def load_sent(module: torch.nn.Module, values: Mapping[str, object]) -> None:
    """Copy the sent `values` into ORT's state in place; the frozen parameters keep theirs.

    Raises:
        ConfigurationError: for other names than the sent ones, or other shapes.
    """
    artifacts: TrainingArtifacts = module.artifacts  # type: ignore[assignment]
    frozen = set(artifacts.manifest.frozen)
    tensors = {name: tensor for name, tensor in state_tensors(module, artifacts).items() if name not in frozen}
    given = {name: torch.as_tensor(value) for name, value in values.items()}
    shapes = {name: tuple(tensor.shape) for name, tensor in given.items()}
    if shapes != {name: tuple(tensor.shape) for name, tensor in tensors.items()}:
        raise ConfigurationError(
            f"Expected the values of the tensors a fleet sends {list(tensors)} (every state tensor but the frozen "
            f"parameters), but got {shapes}; send the values of one export's devices."
        )
    for name, tensor in tensors.items():
        tensor.copy_(given[name])


def whole_values(module: torch.nn.Module, sent: Mapping[str, object]) -> dict[str, object]:
    """The `sent` values completed with copies of the module's own frozen parameters (a rebuild frees its memory)."""
    artifacts: TrainingArtifacts = module.artifacts  # type: ignore[assignment]
    frozen = artifacts.manifest.frozen
    if not frozen:
        return dict(sent)
    tensors = state_tensors(module, artifacts)
    return {name: sent[name] if name in sent else tensors[name].detach().clone() for name in tensors}
