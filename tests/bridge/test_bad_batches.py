"""Batches that ONNX Runtime would refuse with its own error, or accept with a wrong result.

- labels fewer (or more) than the input rows: ORT's ``SoftmaxCrossEntropyLoss`` error becomes one
  `BatchError` that names both counts;
- inputs near float32's limit: the loss stays finite, and ORT's AdamW update writes NaN into the
  parameters (checked against torch's AdamW on the same weights): the fit stops right after that update;
- labels that are all ``ignore_index``: torch's mean loss is NaN (0/0), ORT's is 0.0; the module gives
  torch's NaN (checked against ``F.cross_entropy`` on the same batch), and ``on_nonfinite`` applies.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.errors import BatchError, NonFiniteLossError
from tests.conftest import MLP, Exported, blobs
from tests.helpers import quiet_trainer

BATCH = 8


#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, max_epochs=1, accelerator="cpu", num_sanity_val_steps=0)


def _batches(*batches: tuple[torch.Tensor, torch.Tensor]) -> DataLoader:
    return DataLoader(list(batches), batch_size=None)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ----------------------------------------------------------------------------- labels vs input rows
@pytest.mark.parametrize("labels", [7, 9], ids=["fewer-labels", "more-labels"])
def test_label_count_other_than_the_input_rows_names_both(mlp_adamw: Exported, labels: int) -> None:
    x, y = blobs(BATCH, seed=5)
    bad = (x, torch.randint(0, 3, (labels,)))
    module = ORTLightningModule(mlp_adamw.artifacts)
    before = _weights(module)
    message = rf"Input 'labels' of the training graph has {labels} rows, but 'input' has {BATCH}: both take the batch"
    with pytest.raises(BatchError, match=message + r" axis 'batch' first, one row per sample; return one label"):
        _trainer().fit(module, _batches((x, y), bad))
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters())  # the good batch trained
    with pytest.raises(BatchError, match=rf"Input 'labels' of the eval graph has {labels} rows, but 'input' has 8"):
        module.evaluate_batch(bad)


# ----------------------------------------------------------------------------- an update that overflows
def test_an_update_that_overflows_stops_the_fit_after_it(mlp_adamw: Exported) -> None:
    x, y = blobs(BATCH, seed=6)
    huge = (x * 1e30, y)
    # the reference: torch on the same weights and batch gives a finite loss (ORT's too: no loss guard can see it),
    # and torch's AdamW keeps the parameters finite, where ORT's AdamW update overflows into NaN
    reference = mlp_adamw.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    loss = F.cross_entropy(reference(huge[0]), huge[1])
    loss.backward()
    optimizer.step()
    assert math.isfinite(loss.item())
    assert all(bool(torch.isfinite(p).all()) for p in reference.parameters())

    for policy in ("raise", "skip"):
        module = ORTLightningModule(mlp_adamw.artifacts, lr=1e-3, lr_scheduler="constant", on_nonfinite=policy)
        message = (r"ORT's optimizer update at global_step=0 \(epoch 0\) left NaN/inf values in the parameters "
                   r"\[.*'fc1\.weight'.*\] although the loss was finite: .* resume from the last checkpoint")
        with pytest.raises(NonFiniteLossError, match=message):
            _trainer().fit(module, _batches(huge, (x, y)))
        assert not all(bool(torch.isfinite(p).all()) for p in module.parameters()), "no false alarm"


def test_finite_updates_pass_the_check(mlp_adamw: Exported) -> None:
    x, y = blobs(4 * BATCH, seed=7)
    module = ORTLightningModule(mlp_adamw.artifacts, lr=1e-2)
    _trainer().fit(module, _batches(*zip(x.split(BATCH), y.split(BATCH), strict=True)))
    assert module.trainer.global_step == 4


# ----------------------------------------------------------------------------- labels all ignore_index
def test_labels_all_ignored_give_torch_nan_loss(mlp_adamw: Exported) -> None:
    x, y = blobs(BATCH, seed=8)
    ignored = torch.full((BATCH,), -100)
    partly = torch.where(torch.arange(BATCH) % 2 == 0, y, ignored)
    reference = mlp_adamw.reference()
    module = ORTLightningModule(mlp_adamw.artifacts)
    with torch.no_grad():
        assert math.isnan(F.cross_entropy(reference(x), ignored).item())  # torch: the mean over no label
        expected = F.cross_entropy(reference(x), partly).item()
    assert math.isnan(module.evaluate_batch((x, ignored))[0].item())
    assert module.evaluate_batch((x, partly))[0].item() == pytest.approx(expected, rel=1e-5)


def test_labels_all_ignored_fall_under_on_nonfinite(mlp_adamw: Exported) -> None:
    x, y = blobs(BATCH, seed=9)
    ignored = (x, torch.full((BATCH,), -100))
    module = ORTLightningModule(mlp_adamw.artifacts)
    message = r"The training loss is nan at global_step=1 \(epoch 0, batch 1\);.*labels are all ignore_index"
    with pytest.raises(NonFiniteLossError, match=message):
        _trainer().fit(module, _batches((x, y), ignored))
    module = ORTLightningModule(mlp_adamw.artifacts, on_nonfinite="skip")
    before = _weights(module)
    with pytest.warns(RuntimeWarning, match=r"Skipped an optimizer step: the loss was nan at global_step=0"):
        _trainer().fit(module, _batches(ignored))
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_labels_all_ignored_under_sum_reduction_give_torch_zero(tmp_path: Path) -> None:
    torch.manual_seed(10)
    model = MLP()
    x, _ = blobs(BATCH, seed=10)
    ignored = torch.full((BATCH,), -100)
    with torch.no_grad():
        expected = F.cross_entropy(model(x), ignored, reduction="sum").item()
    artifacts = export_artifacts(model, torch.zeros(2, 4), tmp_path / "sum", verify=False,
                                 loss=torch.nn.CrossEntropyLoss(reduction="sum"))
    assert expected == 0.0
    assert ORTLightningModule(artifacts).evaluate_batch((x, ignored))[0].item() == expected
