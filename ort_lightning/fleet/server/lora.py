"""How a fleet aggregates LoRA adapters (``model.lora``): A and B averaged apart, or A frozen (FFA-LoRA).

A device's update of a LoRA layer is the product B·A. Averaging A and B apart (``separate``, as
Flower's FlowerTune does) gives mean(B)·mean(A), which is not the mean of the products. Freezing
every A at its initial value on every device (``ffa``: Sun et al., "Improving LoRA in
Privacy-preserving Federated Learning", ICLR 2024) leaves B alone to train: mean(B)·A is then the
mean of B·A exactly, and half the adapters' values stay off the wire.
"""

from __future__ import annotations

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError

__all__ = ["check_ffa", "freeze_lora_a"]


def _is_lora_a(name: str) -> bool:
    return ".lora_A." in name or ".lora_embedding_A." in name


def freeze_lora_a(module: torch.nn.Module) -> list[str]:
    """Freeze every LoRA A matrix of a peft model (``requires_grad=False``), before its export; return their names.

    Raises:
        ConfigurationError: for a model without a trainable LoRA A (``ffa`` has nothing to freeze).
    """
    frozen = [name for name, parameter in module.named_parameters() if _is_lora_a(name) and parameter.requires_grad]
    if not frozen:
        raise ConfigurationError(
            f"Expected a peft LoRA model (trainable `lora_A` matrices) for `model.lora: ffa`, but "
            f"{type(module).__name__} has none; wrap the model with peft.get_peft_model(model, LoraConfig(...)), or "
            "use `model.lora: separate`."
        )
    for name, parameter in module.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)
    return frozen


def check_ffa(artifacts: TrainingArtifacts) -> None:
    """Refuse artifacts for ``ffa`` whose LoRA A matrices train (an export made without `freeze_lora_a`).

    Raises:
        ConfigurationError: naming the trainable A matrices.
    """
    training = [name for name in artifacts.manifest.trainable if _is_lora_a(name)]
    if training or not any(_is_lora_a(name) for name in artifacts.manifest.frozen):
        raise ConfigurationError(
            f"`model.lora: ffa` trains B alone, but {artifacts.directory} "
            + (f"trains the LoRA A matrices {training[:2]}{' ...' if len(training) > 2 else ''}" if training
               else "holds no frozen LoRA A matrix")
            + "; export the peft model after freezing every lora_A (requires_grad=False), or let the fleet export its "
            "`model.factory`."
        )
