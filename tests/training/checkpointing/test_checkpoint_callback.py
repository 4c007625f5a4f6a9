"""`ORTCheckpoint` side by side with Lightning's own `ModelCheckpoint` on the same runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty"),
]


class _Noisy(ORTLightningModule):
    """Logs an epoch-level ``val_score`` that goes up and down, so that top-k has choices to make."""

    SCORES = (0.5, 0.2, 0.7, 0.1, 0.4, 0.3)

    def on_validation_epoch_end(self) -> None:
        epoch = self.trainer.current_epoch + self.start_progress["epoch"]
        self.log("val_score", self.SCORES[epoch % len(self.SCORES)])
        self.log("val_loss_ema", 0.25)


def _loaders() -> tuple[DataLoader, DataLoader]:
    x, y = blobs(64, seed=3)
    vx, vy = blobs(32, seed=4)
    return DataLoader(TensorDataset(x, y), batch_size=16), DataLoader(TensorDataset(vx, vy), batch_size=32)


def _fit(
    exported: Exported, callbacks: list[Any], root: Path, ckpt_path: Path | None = None, **options: Any
) -> L.Trainer:
    trainer = quiet_trainer(default_root_dir=root, callbacks=callbacks,
                            **{"max_epochs": 6, "enable_checkpointing": True, **options})
    trainer.fit(_Noisy(exported.artifacts, lr=0.01), *_loaders(), ckpt_path=ckpt_path)
    return trainer


def _names(folder: Path, suffix: str) -> set[str]:
    return {p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}")} if folder.is_dir() else set()


RULES = [
    dict(monitor="val_score", mode="min", save_top_k=2, filename="{epoch}-{val_score:.2f}"),
    dict(monitor="val_score", mode="max", save_top_k=3, every_n_epochs=2),
    dict(save_top_k=-1, filename="{val_score}-{val_loss_ema}"),
    dict(save_top_k=1, every_n_train_steps=5),
    dict(monitor="step", mode="max", save_top_k=2, every_n_train_steps=3),
]


@pytest.mark.parametrize("rule", RULES, ids=["min-top2", "max-top3-every2", "all-two-metrics", "steps", "recent"])
def test_same_files_and_best_as_model_checkpoint(mlp_adamw: Exported, tmp_path: Path, rule: dict) -> None:
    ours = ORTCheckpoint(tmp_path / "ort", save_last=True, **rule)
    theirs = ModelCheckpoint(dirpath=tmp_path / "pl", save_last=True, **rule)
    _fit(mlp_adamw, [ours, theirs], tmp_path)
    kept = _names(tmp_path / "ort", ".ortckpt")
    assert kept == _names(tmp_path / "pl", ".ckpt")
    assert "last" in kept
    assert len(kept) > 1
    assert Path(ours.best_model_path).stem == Path(theirs.best_model_path).stem
    assert {Path(p).stem: float(v) for p, v in ours.best_k_models.items()} == {
        Path(p).stem: float(v) for p, v in theirs.best_k_models.items()
    }
    assert all((tmp_path / "ort" / f"{name}.ortckpt.sha256").is_file() for name in kept)
    CheckpointState.load_checkpoint(str(ours.best_path))


def test_fast_dev_run_writes_nothing_as_model_checkpoint(mlp_adamw: Exported, tmp_path: Path) -> None:
    ours = ORTCheckpoint(tmp_path / "ort", inference_model=tmp_path / "ort" / "model.onnx")
    # NOTE: ModelCheckpoint(save_last=True) writes last.ckpt at train end even under fast_dev_run, against
    # its own skip rule; ORTCheckpoint follows the rule ("fast_dev_run disables checkpointing").
    theirs = ModelCheckpoint(dirpath=tmp_path / "pl")
    trainer = _fit(mlp_adamw, [ours, theirs], tmp_path, fast_dev_run=True)
    assert trainer.global_step == 1
    assert not (tmp_path / "pl").exists() or not any((tmp_path / "pl").iterdir())
    assert not (tmp_path / "ort").exists() or not any((tmp_path / "ort").iterdir())


def test_two_instances_keep_their_own_state_across_a_resume(mlp_adamw: Exported, tmp_path: Path) -> None:
    def callbacks() -> list[Any]:
        return [
            ORTCheckpoint(tmp_path / "low", monitor="val_score", mode="min", save_top_k=2),
            ORTCheckpoint(tmp_path / "high", monitor="val_score", mode="max", save_top_k=2),
            ModelCheckpoint(dirpath=tmp_path / "pl-low", monitor="val_score", mode="min", save_top_k=2, save_last=True),
            ModelCheckpoint(dirpath=tmp_path / "pl-high", monitor="val_score", mode="max", save_top_k=2),
        ]

    first = callbacks()
    _fit(mlp_adamw, first, tmp_path, max_epochs=3)
    assert len({callback.state_key for callback in first}) == 4
    second = callbacks()
    _fit(mlp_adamw, second, tmp_path, ckpt_path=tmp_path / "pl-low" / "last.ckpt")
    low, high, pl_low, pl_high = second
    assert _names(tmp_path / "low", ".ortckpt") - {"last"} == _names(tmp_path / "pl-low", ".ckpt") - {"last"}
    assert _names(tmp_path / "high", ".ortckpt") - {"last"} == _names(tmp_path / "pl-high", ".ckpt")
    assert _names(tmp_path / "low", ".ortckpt") != _names(tmp_path / "high", ".ortckpt")
    for ours, theirs in ((low, pl_low), (high, pl_high)):
        assert {Path(p).stem for p in ours.best_k_models} == {Path(p).stem for p in theirs.best_k_models}
        assert Path(ours.best_model_path).stem == Path(theirs.best_model_path).stem


def test_properties_name_the_file_s_epoch_step_and_score(mlp_adamw: Exported, tmp_path: Path) -> None:
    ours = ORTCheckpoint(tmp_path, monitor="val_score", mode="min", save_top_k=1)
    _fit(mlp_adamw, [ours], tmp_path)
    best = CheckpointState.load_checkpoint(str(ours.best_path))
    assert ours.best_path.name == "epoch=3-step=16.ortckpt"  # val_score 0.1 at epoch 3, 4 steps per epoch
    assert (best.properties["epoch"], best.properties["global_step"]) == (3, 16)
    assert best.properties["monitor_value"] == pytest.approx(0.1)
    assert torch.is_tensor(ours.best_model_score)


def test_checkpointing_turned_off_is_refused_as_for_model_checkpoint(tmp_path: Path) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"enable_checkpointing=False.*found `ModelCheckpoint`"):
        L.Trainer(enable_checkpointing=False, callbacks=[ORTCheckpoint(tmp_path)], logger=False)
