"""Torch parts inside an ORTLightningModule subclass: refused while trainable, counted as frozen once frozen."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule
from ort_lightning.errors import ConfigurationError
from tests.conftest import Exported
from tests.helpers import quiet_trainer


class WithTrunk(ORTLightningModule):
    """A torch trunk in front of the ORT graph (the natural hybrid experiment)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trunk = torch.nn.Linear(4, 4)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        with torch.no_grad():
            return self.trunk(x), y


def _fit(module: ORTLightningModule, train: DataLoader) -> None:
    trainer = quiet_trainer(max_steps=2, accelerator="cpu")
    trainer.fit(module, train)


@pytest.mark.parametrize("optimizer", [None, lambda params: torch.optim.SGD(params, lr=0.1)], ids=["ort", "torch"])
def test_a_trainable_torch_part_is_refused_at_fit_start(
    mlp_adamw: Exported, blob_loaders: tuple[DataLoader, DataLoader], optimizer: Any
) -> None:
    module = WithTrunk(mlp_adamw.artifacts, optimizer=optimizer)
    before = module.trunk.weight.detach().clone()
    with pytest.raises(ConfigurationError, match=(
        r"^Torch parameters \['trunk\.weight', 'trunk\.bias'\] require grad, but no optimizer updates them: .* "
        r"freeze it \(self\.trunk\.requires_grad_\(False\)\), or put that part inside the model you pass to "
        r"export_artifacts"
    )) as info:
        _fit(module, blob_loaders[0])
    assert "\n" not in str(info.value)
    assert torch.equal(module.trunk.weight, before)


def test_a_frozen_torch_part_trains_and_model_summary_counts_only_ort_parameters(
    mlp_adamw: Exported, blob_loaders: tuple[DataLoader, DataLoader]
) -> None:
    module = WithTrunk(mlp_adamw.artifacts)
    module.trunk.requires_grad_(False)
    _fit(module, blob_loaders[0])
    reference = mlp_adamw.reference()
    summary = ModelSummary(module)
    assert summary.trainable_parameters == sum(p.numel() for p in reference.parameters())
    assert summary.total_parameters == summary.trainable_parameters + 4 * 4 + 4
