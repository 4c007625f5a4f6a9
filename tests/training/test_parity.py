"""Parity with plain torch: the same model, weights, batches and optimizer give the same parameters.

The reference is a hand-written torch loop (torch.optim.AdamW / SGD, `loss / N` for
accumulation, torch's own clipping and schedulers); the ORT side is a real Trainer.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from ort_lightning import ORTLightningModule
from tests.conftest import Exported
from tests.training.torch_loop import (
    ADAMW_LR,
    STEPS,
    assert_same_parameters,
    blob_loader,
    cycled,
    linear_factor,
    parity_trainer,
    torch_train,
)

SGD_LR = 0.1


def _fit(exported: Exported, lr: float, **options: object) -> ORTLightningModule:
    schedule = options.pop("lr_scheduler", "constant")
    module = ORTLightningModule(exported.artifacts, lr=lr, lr_scheduler=schedule)  # type: ignore[arg-type]
    parity_trainer(**options).fit(module, blob_loader())
    return module


def _reference_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=ADAMW_LR)
    return torch.optim.SGD(model.parameters(), lr=SGD_LR)


OPTIMIZERS = [("mlp_adamw", "adamw", ADAMW_LR), ("mlp_sgd", "sgd", SGD_LR)]


@pytest.mark.parametrize(("fixture", "kind", "lr"), OPTIMIZERS, ids=["adamw", "sgd"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_parameters_match_torch(
    request: pytest.FixtureRequest, fixture: str, kind: str, lr: float, accumulate: int
) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    module = _fit(exported, lr, accumulate_grad_batches=accumulate)
    reference = exported.reference()
    torch_train(reference, _reference_optimizer(kind, reference), accumulate=accumulate)
    assert_same_parameters(module, reference)


CLIPPING = [
    ("norm", 0.1, lambda params: torch.nn.utils.clip_grad_norm_(params, 0.1)),
    ("value", 0.01, lambda params: torch.nn.utils.clip_grad_value_(params, 0.01)),
]


@pytest.mark.parametrize(("fixture", "kind", "lr"), OPTIMIZERS, ids=["adamw", "sgd"])
@pytest.mark.parametrize(("algorithm", "value", "clip"), CLIPPING, ids=["norm", "value"])
def test_gradient_clipping_matches_torch(
    request: pytest.FixtureRequest, fixture: str, kind: str, lr: float, algorithm: str, value: float, clip
) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    module = _fit(
        exported, lr, gradient_clip_val=value, gradient_clip_algorithm=algorithm, accumulate_grad_batches=2
    )
    reference = exported.reference()
    torch_train(reference, _reference_optimizer(kind, reference), accumulate=2, clip=clip)
    assert_same_parameters(module, reference)
    # The clipping is active: without it torch ends elsewhere.
    unclipped = exported.reference()
    torch_train(unclipped, _reference_optimizer(kind, unclipped), accumulate=2)
    pairs = zip(unclipped.parameters(), reference.parameters(), strict=True)
    assert max((a - b).abs().max().item() for a, b in pairs) > 1e-3


class _SkipsEveryThirdBatch(ORTLightningModule):
    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        return None if batch_idx % 3 == 2 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("fixture", "kind", "lr"), OPTIMIZERS, ids=["adamw", "sgd"])
def test_skipped_micro_batches_count_as_torch_counts_them(
    request: pytest.FixtureRequest, fixture: str, kind: str, lr: float
) -> None:
    # Windows of 2 micro-batches: a skip first, a skip last (earlier gradients still step), none.
    exported: Exported = request.getfixturevalue(fixture)
    module = _SkipsEveryThirdBatch(exported.artifacts, lr=lr, lr_scheduler="constant")
    steps = 12
    parity_trainer(max_steps=steps, accumulate_grad_batches=2).fit(module, blob_loader())
    reference = exported.reference()
    optimizer = _reference_optimizer(kind, reference)
    batches, per_epoch = cycled(blob_loader()), len(blob_loader())
    for window in range(steps):
        for micro in range(2):
            x, y = next(batches)
            if (2 * window + micro) % per_epoch % 3 != 2:  # Lightning's batch_idx restarts each epoch
                (F.cross_entropy(reference(x), y) / 2).backward()
        optimizer.step()  # a parameter whose .grad is None is left alone, as Lightning's torch path does
        optimizer.zero_grad(set_to_none=True)
    assert_same_parameters(module, reference)


def _cosine(step: int, total: int) -> float:
    return (1 + math.cos(math.pi * step / total)) / 2


def _logged_lrs(logger: CSVLogger) -> list[float]:
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("lr-ORTOptimizer")]
    return [float(row["lr-ORTOptimizer"]) for row in sorted(rows, key=lambda row: int(row["step"]))]


def _fit_logged(exported: Exported, tmp_path: Path, **options: object) -> tuple[ORTLightningModule, list[float]]:
    module = ORTLightningModule(exported.artifacts, lr=ADAMW_LR, **options)  # type: ignore[arg-type]
    logger = CSVLogger(tmp_path, name="lr")
    monitor = LearningRateMonitor(logging_interval="step")
    trainer = parity_trainer(logger=logger, callbacks=[monitor], log_every_n_steps=1)
    trainer.fit(module, blob_loader())
    return module, _logged_lrs(logger)


def test_linear_schedule_logs_closed_form_lrs_and_matches_torch(mlp_adamw: Exported, tmp_path: Path) -> None:
    warmup = 5
    module, logged = _fit_logged(mlp_adamw, tmp_path, warmup_steps=warmup)
    expected = [ADAMW_LR * linear_factor(step, warmup, STEPS) for step in range(STEPS)]
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-12)
    reference = mlp_adamw.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=ADAMW_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, warmup, STEPS))
    used = torch_train(reference, optimizer, scheduler=scheduler)
    assert used == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert_same_parameters(module, reference)


def test_a_second_fit_starts_a_fresh_optimizer_and_schedule_as_torch_does(mlp_adamw: Exported) -> None:
    # torch Lightning's configure_optimizers makes a new AdamW and scheduler on every fit; ORT's
    # schedule would otherwise stay at its end (lr 0) and the second fit would not train.
    warmup, steps = 3, 10
    module = ORTLightningModule(mlp_adamw.artifacts, lr=ADAMW_LR, warmup_steps=warmup)
    reference = mlp_adamw.reference()
    for _ in range(2):
        parity_trainer(max_steps=steps).fit(module, blob_loader())
        optimizer = torch.optim.AdamW(reference.parameters(), lr=ADAMW_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, warmup, steps))
        torch_train(reference, optimizer, scheduler=scheduler, steps=steps)
    assert_same_parameters(module, reference)


def test_warmup_fraction_counts_in_total_steps(mlp_adamw: Exported, tmp_path: Path) -> None:
    _, logged = _fit_logged(mlp_adamw, tmp_path, warmup_steps=0.2, total_steps=40)
    expected = [ADAMW_LR * linear_factor(step, 8, 40) for step in range(STEPS)]
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_cosine_factory_matches_torch(mlp_adamw: Exported, tmp_path: Path) -> None:
    def factory(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)

    module, logged = _fit_logged(mlp_adamw, tmp_path, lr_scheduler=factory)
    expected = [ADAMW_LR * _cosine(step, STEPS) for step in range(STEPS)]
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-12)
    reference = mlp_adamw.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=ADAMW_LR)
    torch_train(reference, optimizer, scheduler=factory(optimizer))
    assert_same_parameters(module, reference)


def test_constant_schedule_logs_the_lr(mlp_adamw: Exported, tmp_path: Path) -> None:
    _, logged = _fit_logged(mlp_adamw, tmp_path, lr_scheduler="constant")
    assert logged == pytest.approx([ADAMW_LR] * STEPS)
