"""One real-Trainer test per Lightning feature a user expects to keep working with ORT."""

from __future__ import annotations

import csv
import logging
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelSummary, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from ort_lightning import ORTLightningModule
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer


def _loaders(train: int = 256, val: int = 128) -> tuple[DataLoader, DataLoader]:
    x, y = blobs(train, seed=0)
    vx, vy = blobs(val, seed=1)
    return DataLoader(TensorDataset(x, y), batch_size=32), DataLoader(TensorDataset(vx, vy), batch_size=32)


class _Counter(L.Callback):
    """Counts the batches each loop runs, telling sanity-check validation apart."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counts["train"] += 1

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counts["sanity" if trainer.sanity_checking else "val"] += 1

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self.counts["validations"] += 1


def _reference_loss(exported: Exported, module: ORTLightningModule, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss of the torch model carrying the module's current parameters."""
    reference = exported.reference()
    reference.load_state_dict({name: p.detach().clone() for name, p in module.named_parameters()})
    return F.cross_entropy(reference(x), y).item()


def test_max_steps(mlp_adamw: Exported) -> None:
    train, _ = _loaders()
    counter = _Counter()
    trainer = quiet_trainer(max_steps=5, callbacks=[counter])
    trainer.fit(ORTLightningModule(mlp_adamw.artifacts), train)
    assert trainer.global_step == 5
    assert counter.counts["train"] == 5


def test_val_check_interval(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    counter = _Counter()
    quiet_trainer(max_epochs=1, val_check_interval=0.25, num_sanity_val_steps=0, callbacks=[counter]).fit(
        ORTLightningModule(mlp_adamw.artifacts), train, val
    )
    assert counter.counts["validations"] == 4
    assert counter.counts["val"] == 4 * len(val)


def test_limit_batches(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    counter = _Counter()
    trainer = quiet_trainer(
        max_epochs=2, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0, callbacks=[counter]
    )
    module = ORTLightningModule(mlp_adamw.artifacts)
    trainer.fit(module, train, val)
    assert counter.counts["train"] == 6
    assert trainer.global_step == 6
    assert counter.counts["val"] == 4
    limited = quiet_trainer(limit_test_batches=1).test(module, val, verbose=False)[0]["test_loss"]
    vx, vy = blobs(128, seed=1)
    assert limited == pytest.approx(_reference_loss(mlp_adamw, module, vx[:32], vy[:32]), rel=1e-5)


def test_fast_dev_run(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    counter = _Counter()
    trainer = quiet_trainer(fast_dev_run=True, callbacks=[counter])
    trainer.fit(ORTLightningModule(mlp_adamw.artifacts), train, val)
    assert trainer.global_step == 1
    assert counter.counts == Counter({"train": 1, "val": 1, "validations": 1})


def test_num_sanity_val_steps(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    counter = _Counter()
    quiet_trainer(max_steps=1, num_sanity_val_steps=2, callbacks=[counter]).fit(
        ORTLightningModule(mlp_adamw.artifacts), train, val
    )
    assert counter.counts["sanity"] == 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_model_summary_counts_ort_parameters(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    reference = mlp_adamw.reference()
    # Each torch submodule with parameters, counted on the plain torch model.
    expected = {name: sum(p.numel() for p in child.parameters()) for name, child in reference.named_children()}
    expected = {name: count for name, count in expected.items() if count}
    summary = Summary(module, max_depth=1)
    assert dict(zip(summary.layer_names, summary.param_nums, strict=True)) == expected
    assert set(summary.layer_types) == {"ORTParameters"}
    assert summary.total_parameters == summary.trainable_parameters == sum(expected.values())
    train, _ = _loaders()
    # The ModelSummary callback logs its table at INFO (the suite's conftest quiets lightning.pytorch).
    lines, logger = _Lines(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(lines)
    try:
        quiet_trainer(max_steps=1, enable_model_summary=True, callbacks=[ModelSummary(max_depth=2)]).fit(module, train)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    printed = "\n".join(lines.lines)
    for name, count in expected.items():
        assert re.search(rf"\b{name}\s*\|\s*ORTParameters\s*\|\s*{count}\b", printed), printed
    assert re.search(rf"{sum(expected.values())}\s+Total params", printed), printed


class _Replay(L.LightningModule):
    """A torch module that logs, at epoch e, the e-th recorded ``val_loss`` (Lightning's reference)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.weight ** 2).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.values[self.current_epoch])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Record(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.values.append(trainer.callback_metrics["val_loss"].item())


def test_early_stopping_stops_where_lightning_stops_a_torch_module(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    options = dict(monitor="val_loss", patience=2, min_delta=0.01)
    recorder, stopper = _Record(), EarlyStopping(**options)  # type: ignore[arg-type]
    trainer = quiet_trainer(max_epochs=40, num_sanity_val_steps=0, callbacks=[recorder, stopper])
    trainer.fit(ORTLightningModule(mlp_adamw.artifacts, lr=0.05, lr_scheduler="constant"), train, val)
    reference = EarlyStopping(**options)  # type: ignore[arg-type]
    replayed = quiet_trainer(max_epochs=40, num_sanity_val_steps=0, callbacks=[reference])
    replayed.fit(_Replay(recorder.values + [math.inf] * 40), train, val)
    assert 0 < reference.stopped_epoch < 39, "the logged losses plateau, so Lightning stops early"
    assert (stopper.stopped_epoch, trainer.current_epoch) == (reference.stopped_epoch, replayed.current_epoch)
    assert len(recorder.values) == reference.stopped_epoch + 1


def _csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def test_csv_logger_records_losses_equal_to_torch(mlp_adamw: Exported, tmp_path: Path) -> None:
    train, val = _loaders()
    logger = CSVLogger(tmp_path)
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=1).fit(module, train, val)
    rows = _csv_rows(logger)
    assert sum(1 for row in rows if row.get("train_loss")) == 2 * len(train)
    val_losses = [float(row["val_loss"]) for row in rows if row.get("val_loss")]
    assert len(val_losses) == 2
    vx, vy = blobs(128, seed=1)
    assert val_losses[-1] == pytest.approx(_reference_loss(mlp_adamw, module, vx, vy), rel=1e-5)


def test_tensorboard_logger_writes_losses(mlp_adamw: Exported, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val = _loaders()
    logger = TensorBoardLogger(tmp_path)
    module = ORTLightningModule(mlp_adamw.artifacts)
    quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=2).fit(module, train, val)
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert {"train_loss", "val_loss"} <= set(events.Tags()["scalars"])
    vx, vy = blobs(128, seed=1)
    assert events.Scalars("val_loss")[-1].value == pytest.approx(_reference_loss(mlp_adamw, module, vx, vy), rel=1e-5)


def test_progress_bar_shows_losses(mlp_adamw: Exported, capsys: pytest.CaptureFixture[str]) -> None:
    train, val = _loaders()
    trainer = quiet_trainer(max_epochs=1, enable_progress_bar=True, callbacks=[TQDMProgressBar(refresh_rate=1)])
    trainer.fit(ORTLightningModule(mlp_adamw.artifacts), train, val)
    assert {"train_loss", "val_loss"} <= set(trainer.progress_bar_metrics)
    assert "train_loss=" in capsys.readouterr().out


def test_validate_test_predict_match_torch(mlp_adamw: Exported) -> None:
    _, val = _loaders()
    vx, vy = blobs(128, seed=1)
    module = ORTLightningModule(mlp_adamw.artifacts)
    trainer = quiet_trainer()
    expected = F.cross_entropy(mlp_adamw.reference()(vx), vy).item()
    assert trainer.validate(module, val, verbose=False)[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert trainer.test(module, val, verbose=False)[0]["test_loss"] == pytest.approx(expected, rel=1e-5)
    predictions = trainer.predict(module, val)
    assert predictions is not None
    logits = torch.cat(predictions)  # type: ignore[arg-type]
    torch.testing.assert_close(logits, mlp_adamw.reference()(vx).detach(), rtol=1e-5, atol=1e-6)


def _accuracy(exported: Exported, module: ORTLightningModule, x: torch.Tensor, y: torch.Tensor) -> float:
    reference = exported.reference()
    reference.load_state_dict({name: p.detach().clone() for name, p in module.named_parameters()})
    return (reference(x).argmax(dim=1) == y).float().mean().item()


def test_metrics_are_logged_per_stage(mlp_adamw: Exported) -> None:
    train, val = _loaders()
    vx, vy = blobs(128, seed=1)
    metric = MulticlassAccuracy(num_classes=3, average="micro")
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01, metrics=metric)
    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(module, train, val)
    assert "train_MulticlassAccuracy" in trainer.callback_metrics
    logged = trainer.callback_metrics["val_MulticlassAccuracy"].item()
    assert logged == pytest.approx(_accuracy(mlp_adamw, module, vx, vy))
    tested = trainer.test(module, val, verbose=False)[0]
    assert tested["test_MulticlassAccuracy"] == pytest.approx(_accuracy(mlp_adamw, module, vx, vy))


def test_metrics_dict_names(mlp_adamw: Exported) -> None:
    _, val = _loaders()
    vx, vy = blobs(128, seed=1)
    module = ORTLightningModule(
        mlp_adamw.artifacts, metrics={"acc": MulticlassAccuracy(num_classes=3, average="micro")}
    )
    result = quiet_trainer().validate(module, val, verbose=False)[0]
    assert result["val_acc"] == pytest.approx(_accuracy(mlp_adamw, module, vx, vy))
