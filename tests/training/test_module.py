"""ORTLightningModule on a real Trainer: the first fit."""

from __future__ import annotations

import pytest

from ort_lightning import ORTLightningModule
from ort_lightning.errors import ConfigurationError
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer


def test_fit_lowers_val_loss_and_reaches_accuracy(mlp_adamw: Exported, blob_loaders) -> None:
    train, val = blob_loaders
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.05)
    trainer = quiet_trainer(max_epochs=2)
    before = trainer.validate(module, val, verbose=False)[0]["val_loss"]
    trainer.fit(module, train, val)
    after = trainer.callback_metrics["val_loss"].item()
    assert after < before * 0.5
    vx, vy = blobs(256, seed=1)
    accuracy = (module(vx).argmax(dim=1) == vy).float().mean().item()
    assert accuracy > 0.9


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "64-true"], ids=str)
def test_precision_other_than_32_true_is_refused(mlp_adamw: Exported, blob_loaders, precision: str) -> None:
    train, _ = blob_loaders
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(ConfigurationError, match=r"precision=.*use Trainer\(precision='32-true'\)"):
        quiet_trainer(max_epochs=1, precision=precision).fit(module, train)
