"""The values a fleet exchanges: every tensor of ORT's state, in the training graph's order.

A client sends the values of its CheckpointState (trainable and frozen parameters, and
buffers such as BatchNorm running statistics) in the order the training graph takes them as
inputs, which is the order of ORT's contiguous parameter buffer, not the alphabetical order in
which the CheckpointState lists them. Setting values copies them into the torch views of ORT's
memory through the one operation that changes a running session (``values=`` alone): ORT's state
is updated in place and no ORT object is rebuilt.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(),
    ...                                               verify=False))
    >>> state_order(module.artifacts)
    ['weight', 'bias']
    >>> values = get_values(module)
    >>> set_values(module, {name: torch.zeros_like(value) for name, value in values.items()})
    >>> float(module.weight.detach().abs().sum())
    0.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import state_specs
from ort_lightning.errors import ConfigurationError

if TYPE_CHECKING:
    from ort_lightning.training.module import ORTLightningModule

__all__ = ["get_values", "set_values", "state_order", "state_tensors"]


def state_order(artifacts: TrainingArtifacts) -> list[str]:
    """Names of ORT's state tensors in the order the training graph takes them.

    Args:
        artifacts: the artifacts whose training graph sets the order.

    Returns:
        Parameter and buffer names, as ``named_parameters()`` / ``named_buffers()`` spell them.
    """
    return [spec.name for spec in state_specs(artifacts)]


def state_tensors(module: torch.nn.Module, artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """The module's views of ORT's state tensors, keyed by name, in `state_order`.

    Raises:
        ConfigurationError: when the module lacks a tensor the training graph takes.
    """
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    order = state_order(artifacts)
    missing = [name for name in order if name not in tensors]
    if missing:
        raise ConfigurationError(
            f"The training graph of {artifacts.directory} takes state tensors {missing} that the module does not "
            "have; build the module from these artifacts (ORTLightningModule(artifacts))."
        )
    return {name: tensors[name] for name in order}


def get_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the values of ORT's state, keyed by name, in the training graph's order.

    Args:
        module: an `ORTLightningModule` (its ``artifacts`` set the order).
    """
    artifacts: TrainingArtifacts = module.artifacts  # type: ignore[assignment]
    return {name: tensor.detach().cpu().clone() for name, tensor in state_tensors(module, artifacts).items()}


def set_values(module: ORTLightningModule, values: Mapping[str, object]) -> None:
    """Copy `values` into ORT's state in place (no ORT object is rebuilt): `ORTLightningModule.set_values`.

    The module's optimizer state and training progress stay as they are (a server's module, a
    device that evaluates); a device that trains starts again with `ORTLightningModule.load_values`.

    Args:
        module: an `ORTLightningModule`.
        values: name -> tensor or numpy array, for every state tensor of the training graph.

    Raises:
        ConfigurationError: for missing, unexpected or misshapen values.
    """
    module.set_values(values)
