"""Schedules as torch has them: short runs, skipped steps, Lightning's scheduler dict, resume with ``checkpoint=``.

References: a plain torch loop with torch's AdamW and scheduler, a Lightning module of the same
torch model, and the closed form of the linear schedule written here.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from ort_lightning.errors import ConfigurationError
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

pytestmark = [pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")]

LR, BATCH, PER_EPOCH = 0.02, 16, 4


def _loader(poisoned: int | None = None) -> DataLoader:
    x, y = blobs(PER_EPOCH * BATCH, seed=8)
    if poisoned is not None:
        x[poisoned * BATCH, 0] = math.nan
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _val_loader() -> DataLoader:
    x, y = blobs(64, seed=9)
    return DataLoader(TensorDataset(x, y), batch_size=64)


def _trainer(root: Path, **options: object) -> L.Trainer:
    """The quiet Trainer that logs the learning rate of every step to a CSV file under `root`."""
    callbacks = [LearningRateMonitor(logging_interval="step"), *options.pop("callbacks", [])]  # type: ignore[misc]
    defaults = dict(accelerator="cpu", num_sanity_val_steps=0, default_root_dir=root,
                    logger=CSVLogger(root, name="lr"), log_every_n_steps=1)
    return quiet_trainer(**{**defaults, **options, "callbacks": callbacks})


def _logged_lrs(trainer: L.Trainer, key: str = "lr-ORTOptimizer") -> list[float]:
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as handle:  # type: ignore[union-attr]
        rows = [row for row in csv.DictReader(handle) if row.get(key)]
    return [float(row[key]) for row in sorted(rows, key=lambda row: int(row["step"]))]


def _linear(step: int, warmup: int, total: int) -> float:
    """The closed form, written here independently of the package."""
    if step < warmup:
        return step / warmup
    return max(0.0, (total - step) / (total - warmup))


def _torch_fit(
    model: torch.nn.Module,
    steps: int,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    *,
    skipped: tuple[int, ...] = (),
    per_epoch: Callable[[Any], None] | None = None,
) -> list[float]:
    """Plain torch: AdamW, one batch per step, `skipped` steps leave out the update but step the scheduler."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = None if scheduler is None else scheduler(optimizer)
    batches, used = list(_loader()), []
    for step in range(steps):
        x, y = batches[step % PER_EPOCH]
        F.cross_entropy(model(x), y).backward()
        used.append(optimizer.param_groups[0]["lr"])
        if step not in skipped:
            optimizer.step()
        optimizer.zero_grad()
        if schedule is not None and per_epoch is None:
            schedule.step()
        if per_epoch is not None and step % PER_EPOCH == PER_EPOCH - 1:
            per_epoch(schedule)
    return used


def _assert_parameters(module: ORTLightningModule, reference: torch.nn.Module, atol: float = 1e-5) -> None:
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(module.get_parameter(name).detach(), parameter.detach(), rtol=0, atol=atol)


# ----------------------------------------------------------------------------- short runs
def test_a_run_shorter_than_the_warmup_stays_in_the_warmup_as_torch_does(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=LR, warmup_steps=10)
    trainer = _trainer(tmp_path, max_steps=4)
    trainer.fit(module, _loader())
    expected = [LR * _linear(step, 10, 4) for step in range(4)]
    assert expected == pytest.approx([0.0, 0.1 * LR, 0.2 * LR, 0.3 * LR])
    assert _logged_lrs(trainer) == pytest.approx(expected, rel=1e-6, abs=1e-12)
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 4, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _linear(s, 10, 4)))
    assert used == pytest.approx(expected, rel=1e-6, abs=1e-12)
    _assert_parameters(module, reference)


class _RecordLr(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


def test_fast_dev_run_with_a_long_warmup_runs_its_step_at_the_warmup_lr(mlp_adamw: Exported, tmp_path: Path) -> None:
    recorder = _RecordLr()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=LR, warmup_steps=100)
    quiet_trainer(fast_dev_run=True, accelerator="cpu", callbacks=[recorder], default_root_dir=tmp_path).fit(
        module, _loader())
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 1, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _linear(s, 100, 1)))
    assert recorder.lrs == used == [0.0]
    _assert_parameters(module, reference, atol=0)


# ----------------------------------------------------------------------------- a skipped step
SCHEDULES = [
    ("linear", dict(warmup_steps=3, total_steps=8), lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: _linear(s, 3, 8))),
    ("step-lr", dict(lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)),
     lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)),
]


@pytest.mark.filterwarnings("ignore:Skipped an optimizer step")
@pytest.mark.parametrize(("kind", "options", "reference_schedule"), SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_after_a_skipped_step_the_schedule_follows_global_step_as_torch_does(
    mlp_adamw: Exported, tmp_path: Path, kind: str, options: dict[str, Any], reference_schedule: Any
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=LR, on_nonfinite="skip", **options)
    trainer = _trainer(tmp_path, max_steps=8)
    trainer.fit(module, _loader(poisoned=2))
    assert module.skipped_steps == 2  # batch 2 of both epochs
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 8, reference_schedule, skipped=(2, 6))
    assert _logged_lrs(trainer) == pytest.approx(used, rel=1e-6, abs=1e-12)
    _assert_parameters(module, reference)


# ----------------------------------------------------------------------------- Lightning's scheduler dict
def test_dict_with_an_epoch_interval_steps_per_epoch_as_torch(mlp_adamw: Exported, tmp_path: Path) -> None:
    config = {"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
              "interval": "epoch"}
    module = ORTLightningModule(mlp_adamw.artifacts, lr=LR, lr_scheduler=config)
    trainer = _trainer(tmp_path, max_epochs=3)
    trainer.fit(module, _loader())
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 3 * PER_EPOCH, lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                      per_epoch=lambda schedule: schedule.step())
    assert used == [LR * 0.5**epoch for epoch in range(3) for _ in range(PER_EPOCH)]
    assert _logged_lrs(trainer) == pytest.approx(used, rel=1e-6)
    _assert_parameters(module, reference)


class _TorchModule(L.LightningModule):
    """The reference: the same torch model under Lightning with torch's AdamW and the same scheduler dict."""

    def __init__(self, model: torch.nn.Module, config: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.config = model, config

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self.model(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        scheduler = {**self.config, "scheduler": self.config["scheduler"](optimizer)}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def test_dict_with_reduce_on_plateau_matches_a_torch_lightning_module(mlp_adamw: Exported, tmp_path: Path) -> None:
    config = {
        "scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.3),
        "monitor": "val_loss", "interval": "epoch", "frequency": 1,
    }
    module = ORTLightningModule(mlp_adamw.artifacts, lr=LR, lr_scheduler=config)
    trainer = _trainer(tmp_path / "ort", max_epochs=4)
    trainer.fit(module, _loader(), _val_loader())
    reference = _TorchModule(mlp_adamw.reference(), config)
    torch_trainer = _trainer(tmp_path / "torch", max_epochs=4)
    torch_trainer.fit(reference, _loader(), _val_loader())
    lrs = _logged_lrs(trainer)
    assert lrs == pytest.approx(_logged_lrs(torch_trainer, "lr-AdamW"), rel=1e-6)
    assert min(lrs) < LR, "the plateau scheduler reduced the lr at least once"
    _assert_parameters(module, reference.model)


def test_dict_without_a_factory_is_refused(mlp_adamw: Exported) -> None:
    with pytest.raises(ConfigurationError, match=r"`lr_scheduler` as a dict to be Lightning's scheduler config .*"
                                                 r"'interval' in \['step', 'epoch'\]"):
        ORTLightningModule(mlp_adamw.artifacts, lr_scheduler={"scheduler": None, "interval": "batch"})


# ----------------------------------------------------------------------------- resume with checkpoint=
def _names(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("epoch=*.ortckpt"))


def test_a_resumed_run_continues_epochs_steps_and_schedule_like_the_uninterrupted_one(
    mlp_adamw: Exported, tmp_path: Path
) -> None:
    schedule = dict(lr=LR, warmup_steps=2, total_steps=6 * PER_EPOCH)
    straight = ORTLightningModule(mlp_adamw.artifacts, **schedule)
    _trainer(tmp_path / "s", max_epochs=6, callbacks=[ORTCheckpoint(tmp_path / "straight", save_top_k=-1)]).fit(
        straight, _loader())
    first = ORTLightningModule(mlp_adamw.artifacts, **schedule)
    saver = ORTCheckpoint(tmp_path / "resumed", save_top_k=-1)
    _trainer(tmp_path / "a", max_epochs=3, callbacks=[saver]).fit(first, _loader())
    # the rule: lr, warmup_steps and total_steps not given come from the checkpoint; the schedule goes on
    resumed = ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "resumed" / "last.ortckpt")
    assert (resumed.lr, resumed.warmup_steps, resumed.total_steps) == (LR, 2, 6 * PER_EPOCH)
    trainer = _trainer(tmp_path / "b", max_epochs=3, callbacks=[ORTCheckpoint(tmp_path / "resumed", save_top_k=-1)])
    trainer.fit(resumed, _loader())
    assert _names(tmp_path / "resumed") == _names(tmp_path / "straight") == [
        f"epoch={e}-step={(e + 1) * PER_EPOCH}.ortckpt" for e in range(6)]
    for name in ("last.ortckpt", f"epoch=5-step={6 * PER_EPOCH}.ortckpt"):
        ours, theirs = (
            CheckpointState.load_checkpoint(tmp_path / d / name).properties
            for d in ("resumed", "straight")
        )
        assert (ours["epoch"], ours["global_step"]) == (theirs["epoch"], theirs["global_step"]) == (5, 6 * PER_EPOCH)
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 6 * PER_EPOCH, lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: _linear(s, 2, 6 * PER_EPOCH)))
    assert _logged_lrs(trainer) == pytest.approx(used[3 * PER_EPOCH:], rel=1e-6, abs=1e-12)
    for name, parameter in straight.named_parameters():
        assert torch.equal(resumed.get_parameter(name), parameter), name
    _assert_parameters(resumed, reference)


def test_a_torch_scheduler_resumed_with_checkpoint_continues_at_the_restored_step(
    mlp_adamw: Exported, tmp_path: Path
) -> None:
    def factory(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    first = ORTLightningModule(mlp_adamw.artifacts, lr=LR, lr_scheduler=factory)
    _trainer(tmp_path / "a", max_epochs=1, callbacks=[ORTCheckpoint(tmp_path / "ckpt")]).fit(first, _loader())
    resumed = ORTLightningModule(mlp_adamw.artifacts, lr=LR, lr_scheduler=factory,
                                 checkpoint=tmp_path / "ckpt" / "last.ortckpt")
    trainer = _trainer(tmp_path / "b", max_epochs=1)
    trainer.fit(resumed, _loader())
    reference = mlp_adamw.reference()
    used = _torch_fit(reference, 2 * PER_EPOCH, factory)
    assert _logged_lrs(trainer) == pytest.approx(used[PER_EPOCH:], rel=1e-6)
    _assert_parameters(resumed, reference)
