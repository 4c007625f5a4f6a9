"""Hybrid training: ORT's gradients, a torch optimizer's update, against the same torch optimizer in plain torch.

The reference is a hand-written torch loop over the torch model the artifacts came from, with
the same optimizer class and options, ``loss / N`` for accumulation and torch's own clipping
and schedulers; the ORT side is a real Trainer over real artifacts.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from ort_lightning import ORTLightningModule
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.runtime import checkpoint_summary
from tests.conftest import Exported
from tests.helpers import ROOT
from tests.strategies import ddp_run
from tests.training.torch_loop import assert_same_parameters, blob_loader, linear_factor, parity_trainer, torch_train

STEPS = 30
EPOCH = 16  # batches of 32 in the 512 blob samples


def adamw_fused(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, fused=True)  # type: ignore[arg-type]


def sgd_nesterov(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)  # type: ignore[arg-type]


FACTORIES = [pytest.param(adamw_fused, id="adamw-fused"), pytest.param(sgd_nesterov, id="sgd-nesterov-wd")]
Factory = Callable[[object], torch.optim.Optimizer]


def _hybrid(exported: Exported, factory: Factory, **options: object) -> ORTLightningModule:
    options.setdefault("lr_scheduler", "constant")
    return ORTLightningModule(exported.artifacts, optimizer=factory, **options)  # type: ignore[arg-type]


def _clip(params: list[torch.nn.Parameter]) -> object:
    return torch.nn.utils.clip_grad_norm_(params, 0.5)


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize(
    ("accumulate", "clip"), [(1, None), (2, 0.5)], ids=["plain", "accumulate-2-clip-norm"]
)
def test_parameters_match_the_same_torch_optimizer(
    mlp_adamw: Exported, factory: Factory, accumulate: int, clip: float | None
) -> None:
    module = _hybrid(mlp_adamw, factory)
    trainer = parity_trainer(max_steps=STEPS, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    trainer.fit(module, blob_loader())
    reference = mlp_adamw.reference()
    torch_train(
        reference, factory(reference.parameters()), accumulate=accumulate, clip=_clip if clip else None, steps=STEPS
    )
    assert_same_parameters(module, reference)
    if clip:  # the clipping is active: without it torch ends elsewhere
        unclipped = mlp_adamw.reference()
        torch_train(unclipped, factory(unclipped.parameters()), accumulate=accumulate, steps=STEPS)
        pairs = zip(unclipped.parameters(), reference.parameters(), strict=True)
        assert max((a - b).abs().max().item() for a, b in pairs) > 1e-3


def _logged(logger: CSVLogger, key: str) -> list[float]:
    import csv

    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get(key)]
    return [float(row[key]) for row in sorted(rows, key=lambda row: int(row["step"]))]


SCHEDULES = [
    pytest.param("linear", lambda step: 0.01 * linear_factor(step, 5, STEPS), id="linear"),
    pytest.param(
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
        lambda step: 0.01 * (1 + math.cos(math.pi * step / STEPS)) / 2,
        id="cosine-factory",
    ),
]


@pytest.mark.parametrize(("schedule", "closed_form"), SCHEDULES)
def test_schedules_drive_the_torch_optimizer(
    mlp_adamw: Exported, tmp_path: Path, schedule: object, closed_form: Callable[[int], float]
) -> None:
    module = _hybrid(mlp_adamw, adamw_fused, lr_scheduler=schedule, warmup_steps=5)
    logger = CSVLogger(tmp_path, name="lr")
    trainer = parity_trainer(
        max_steps=STEPS, logger=logger, callbacks=[LearningRateMonitor(logging_interval="step")], log_every_n_steps=1
    )
    trainer.fit(module, blob_loader())
    expected = [closed_form(step) for step in range(STEPS)]
    assert _logged(logger, "lr-AdamW") == pytest.approx(expected, rel=1e-6, abs=1e-12)
    reference = mlp_adamw.reference()
    optimizer = adamw_fused(reference.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: closed_form(step) / 0.01)
    torch_train(reference, optimizer, scheduler=scheduler, steps=STEPS)
    assert_same_parameters(module, reference)


def test_resume_from_ckpt_path_continues_exactly(mlp_adamw: Exported, tmp_path: Path) -> None:
    options = dict(lr_scheduler="linear", warmup_steps=4, total_steps=2 * EPOCH)
    first = _hybrid(mlp_adamw, adamw_fused, **options)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    parity_trainer(max_epochs=1, max_steps=-1, enable_checkpointing=True, callbacks=[saver]).fit(first, blob_loader())
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    moments = saved["optimizer_states"][0]["state"][0]
    assert float(moments["step"]) == EPOCH  # torch's AdamW state
    assert moments["exp_avg"].abs().sum() > 0

    resumed = _hybrid(mlp_adamw, adamw_fused, **options)
    parity_trainer(max_epochs=2, max_steps=-1).fit(resumed, blob_loader(), ckpt_path=tmp_path / "last.ckpt")
    reference = mlp_adamw.reference()
    optimizer = adamw_fused(reference.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, 4, 2 * EPOCH))
    torch_train(reference, optimizer, scheduler=scheduler, steps=2 * EPOCH)
    assert_same_parameters(resumed, reference)


def test_ort_checkpoint_holds_weights_and_starts_a_fresh_torch_optimizer(mlp_adamw: Exported, tmp_path: Path) -> None:
    first = _hybrid(mlp_adamw, sgd_nesterov)
    parity_trainer(max_steps=EPOCH).fit(first, blob_loader())
    path = first.save_ort_checkpoint(tmp_path / "hybrid.ortckpt")
    ort_optimizer = ORTLightningModule(mlp_adamw.artifacts).save_ort_checkpoint(tmp_path / "ort.ortckpt")
    # weights only: a third of the size of a file with AdamW's two moments
    assert path.stat().st_size < 0.5 * ort_optimizer.stat().st_size
    assert {name for name, _, _ in checkpoint_summary(path)[0]} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}

    second = _hybrid(mlp_adamw, sgd_nesterov, checkpoint=path)
    parity_trainer(max_steps=EPOCH).fit(second, blob_loader())
    reference = mlp_adamw.reference()
    torch_train(reference, sgd_nesterov(reference.parameters()), steps=EPOCH)
    torch_train(reference, sgd_nesterov(reference.parameters()), steps=EPOCH)  # fresh momentum
    assert_same_parameters(second, reference)
    continued = mlp_adamw.reference()
    torch_train(continued, sgd_nesterov(continued.parameters()), steps=2 * EPOCH)
    pairs = zip(continued.parameters(), reference.parameters(), strict=True)
    assert max((a - b).abs().max().item() for a, b in pairs) > 1e-4  # the fresh momentum mattered


class _PoisonsBatch(ORTLightningModule):
    """Multiplies one batch's inputs by inf: its loss is not finite."""

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        x, y = batch  # type: ignore[misc]
        return super().training_step((x * math.inf if batch_idx == 3 else x, y), batch_idx)


def test_nonfinite_skip_leaves_the_torch_optimizer_untouched(mlp_adamw: Exported) -> None:
    module = _PoisonsBatch(mlp_adamw.artifacts, optimizer=sgd_nesterov, lr_scheduler="constant", on_nonfinite="skip")
    with pytest.warns(RuntimeWarning, match="Skipped an optimizer step"):
        parity_trainer(max_steps=8).fit(module, blob_loader())
    reference = mlp_adamw.reference()
    optimizer = sgd_nesterov(reference.parameters())
    for index, (x, y) in enumerate(list(blob_loader())[:8]):  # a skipped step counts as a step
        if index == 3:
            continue  # skipped: no update, no momentum
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_same_parameters(module, reference)


@pytest.mark.slow  # two DDP ranks
def test_two_ddp_ranks_match_torch_with_the_double_batch(mlp_adamw: Exported, tmp_path: Path) -> None:
    import subprocess

    steps, batch = 10, 8
    command = [sys.executable, "-m", "tests.strategies.ddp_run", str(mlp_adamw.artifacts.directory), str(tmp_path),
               "--devices=2", f"--batch={batch}", f"--steps={steps}", "--optimizer=sgd-nesterov"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    reference = mlp_adamw.reference()
    optimizer = ddp_run.sgd_nesterov(reference.parameters())
    x, y = ddp_run.dataset("mlp", steps * batch * 2)  # what ddp_run.train draws: one epoch of the steps
    for step in range(steps):
        window = slice(step * 2 * batch, (step + 1) * 2 * batch)
        torch.nn.functional.cross_entropy(reference(x[window]), y[window]).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    for rank in (0, 1):
        state = ddp_run.load(tmp_path, rank)["state"]
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)


def test_an_optimizer_instance_is_refused(mlp_adamw: Exported) -> None:
    instance = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(ConfigurationError, match=r"Expected argument `optimizer` to be None .* or a callable params"):
        ORTLightningModule(mlp_adamw.artifacts, optimizer=instance)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        pytest.param(lambda params: "adamw", r"to return a torch.optim.Optimizer, but it returned str",
                     id="not-an-optimizer"),
        pytest.param(lambda params: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1),
                     r"holds 1 tensor\(s\) that are not the module's trainable parameters", id="foreign-tensors"),
    ],
)
def test_a_factory_returning_something_unusable_is_refused(mlp_adamw: Exported, factory: Factory, message: str) -> None:
    module = _hybrid(mlp_adamw, factory)
    with pytest.raises(ConfigurationError, match=message):
        module.configure_optimizers()


def test_checkpoint_resume_restarts_the_linear_schedule_with_the_fresh_torch_optimizer(
    mlp_adamw: Exported, tmp_path: Path
) -> None:
    options = dict(lr_scheduler="linear", warmup_steps=4, total_steps=2 * EPOCH)
    first = _hybrid(mlp_adamw, adamw_fused, **options)
    parity_trainer(max_steps=EPOCH).fit(first, blob_loader())
    path = first.save_ort_checkpoint(tmp_path / "half.ortckpt")
    second = _hybrid(mlp_adamw, adamw_fused, checkpoint=path, **options)
    parity_trainer(max_steps=EPOCH).fit(second, blob_loader())
    reference = mlp_adamw.reference()
    # weights only in the file: the second half starts a fresh AdamW, and its warmup, from step 0
    for _ in range(2):
        optimizer = adamw_fused(reference.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, 4, 2 * EPOCH))
        torch_train(reference, optimizer, scheduler=scheduler, steps=EPOCH)
    assert_same_parameters(second, reference)


def test_lightning_scheduler_dict_steps_the_torch_optimizer_per_epoch(mlp_adamw: Exported) -> None:
    schedule = {"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                "interval": "epoch"}
    module = _hybrid(mlp_adamw, sgd_nesterov, lr_scheduler=schedule)
    parity_trainer(max_epochs=2, max_steps=-1).fit(module, blob_loader())
    reference = mlp_adamw.reference()
    optimizer = sgd_nesterov(reference.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):  # one epoch of 16 steps, then the epoch's scheduler step
        torch_train(reference, optimizer, steps=EPOCH)
        scheduler.step()
    assert_same_parameters(module, reference)
    assert module.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)
