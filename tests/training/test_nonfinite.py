"""NaN/inf losses on a real Trainer: ``on_nonfinite="raise"`` stops before the update, ``"skip"`` drops it."""

from __future__ import annotations

import math
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.errors import ConfigurationError, NonFiniteLossError
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

BATCH = 8


def _loader(poisoned: int, value: float) -> DataLoader:
    """64 blob samples in 8 batches, one value of batch `poisoned` replaced by `value` (inf or NaN)."""
    x, y = blobs(8 * BATCH, seed=3)
    x[poisoned * BATCH, 0] = value
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, max_epochs=1, accelerator="cpu")


def _weights(module: ORTLightningModule) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


class Snapshots(pl.Callback):
    """Parameters before each training batch and after each one, by batch index."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.before[batch_idx] = _weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.after[batch_idx] = _weights(pl_module)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def _finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(w).all()) for w in weights.values())


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_raise_names_the_step_before_the_update(mlp_adamw: Exported, value: float) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.05)
    snapshots = Snapshots()
    trainer = _trainer(callbacks=[snapshots])
    message = r"training loss is (nan|inf) at global_step=3 \(epoch 0, batch 3\).*on_nonfinite='skip'"
    with pytest.raises(NonFiniteLossError, match=message):
        trainer.fit(module, _loader(3, value))
    assert _equal(_weights(module), snapshots.before[3]), "the update of the bad batch must not have run"
    assert _finite(_weights(module))


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
def test_skip_drops_the_update_warns_and_training_goes_on(mlp_adamw: Exported, value: float) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.05, on_nonfinite="skip")
    snapshots = Snapshots()
    trainer = _trainer(callbacks=[snapshots])
    with pytest.warns(RuntimeWarning, match=r"Skipped an optimizer step: the loss was (nan|inf) at global_step=3 "):
        trainer.fit(module, _loader(3, value))
    assert _equal(snapshots.after[3], snapshots.before[3]), "a skipped step must leave the parameters as they were"
    assert not _equal(snapshots.after[4], snapshots.after[3]), "training must go on after the skip"
    assert _finite(_weights(module))
    assert module.skipped_steps == 1
    assert trainer.global_step == 8


@pytest.mark.parametrize("poisoned", [2, 3], ids=["first-micro-batch", "second-micro-batch"])
def test_skip_drops_the_whole_accumulated_step(mlp_adamw: Exported, poisoned: int) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.05, on_nonfinite="skip")
    snapshots = Snapshots()
    trainer = _trainer(callbacks=[snapshots], accumulate_grad_batches=2)
    with pytest.warns(RuntimeWarning, match=r"Skipped an optimizer step: the loss was (nan|inf) at global_step=1 "):
        trainer.fit(module, _loader(poisoned, math.inf))
    # batches 2 and 3 make optimizer step 1: neither micro-batch may reach the parameters
    assert _equal(snapshots.after[3], snapshots.before[2])
    assert not _equal(snapshots.after[1], snapshots.before[0])
    assert not _equal(snapshots.after[5], snapshots.after[3]), "the next accumulated step must update again"
    assert _finite(_weights(module))


@pytest.mark.parametrize(("fixture", "optimizer"), [("mlp_sgd", torch.optim.SGD), ("mlp_adamw", torch.optim.AdamW)],
                         ids=["sgd", "adamw"])
def test_a_skipped_step_equals_torch_training_without_that_batch(
    request: pytest.FixtureRequest, fixture: str, optimizer: type[torch.optim.Optimizer]
) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    skipped = ORTLightningModule(exported.artifacts, lr=0.05, on_nonfinite="skip", lr_scheduler="constant")
    with pytest.warns(RuntimeWarning, match="Skipped an optimizer step"):
        _trainer().fit(skipped, _loader(3, math.nan))
    # plain torch on the same batches, with no update for batch 3
    reference = exported.reference()
    torch_optimizer = optimizer(reference.parameters(), lr=0.05)
    x, y = blobs(8 * BATCH, seed=3)
    for batch in (0, 1, 2, 4, 5, 6, 7):
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        F.cross_entropy(reference(x[rows]), y[rows]).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    for name, weight in reference.named_parameters():
        torch.testing.assert_close(_weights(skipped)[name], weight.detach(), rtol=0, atol=1e-5)


def test_unknown_policy_is_refused(mlp_adamw: Exported) -> None:
    with pytest.raises(ConfigurationError, match=r"`on_nonfinite` to be one of \['raise', 'skip'\], but got 'ignore'"):
        ORTLightningModule(mlp_adamw.artifacts, on_nonfinite="ignore")
