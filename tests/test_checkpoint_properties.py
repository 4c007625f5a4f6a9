"""Every property of an ORT checkpoint file is the writing run's own: none comes over from the file a run started from.

ONNX Runtime saves every property its CheckpointState holds, those it was loaded with among them. A
first run here monitors ``val_loss`` (the eval graph's loss, logged by the module) with two callbacks
beside it (one that monitors nothing, and Lightning's ``ModelCheckpoint``); each later run starts
from one of its files with another configuration, and the files it writes are read back with ONNX
Runtime's own ``CheckpointState``.
The expected steps and epochs are counted from the data (4 batches an epoch), not read from the code.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

BATCHES = 4  # 64 samples in batches of 16
FIRST_EPOCHS = 2
#: What only a run that monitors, or a fleet server, writes.
MONITOR = {"monitor", "monitor_value"}
SCHEDULE = {"schedule_lr", "schedule_warmup_steps", "schedule_total_steps"}


def _loaders() -> tuple[DataLoader, DataLoader]:
    x, y = blobs(64, seed=3)
    vx, vy = blobs(32, seed=4)
    return DataLoader(TensorDataset(x, y), batch_size=16), DataLoader(TensorDataset(vx, vy), batch_size=32)


def properties(path: Path) -> dict[str, Any]:
    """The file's properties, read with ONNX Runtime's own API."""
    return dict(CheckpointState.load_checkpoint(str(path)).properties)  # NOTE: ORT's bag iterates (name, value)


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.ortckpt"))
    assert files, f"nothing written in {folder}"
    return files


@dataclass(frozen=True)
class FirstRun:
    monitored: Path
    plain: Path
    lightning: Path


@pytest.fixture(scope="module")
def first_run(mlp_adamw: Exported) -> FirstRun:
    root = Path(tempfile.mkdtemp(prefix="first-run-"))
    run = FirstRun(root / "monitored", root / "plain", root / "lightning")
    callbacks = [ORTCheckpoint(run.monitored, monitor="val_loss", mode="min", save_top_k=2),
                 ORTCheckpoint(run.plain, every_n_train_steps=3),
                 ModelCheckpoint(dirpath=run.lightning, save_last=True)]
    trainer = quiet_trainer(max_epochs=FIRST_EPOCHS, callbacks=callbacks, default_root_dir=root)
    trainer.fit(ORTLightningModule(mlp_adamw.artifacts, lr=0.01, total_steps=100), *_loaders())
    return run


def _fit(module: ORTLightningModule, folder: Path, *, epochs: int, ckpt_path: Path | None = None) -> None:
    callback = ORTCheckpoint(folder)
    trainer = quiet_trainer(max_epochs=epochs, callbacks=[callback], default_root_dir=folder.parent)
    trainer.fit(module, *_loaders(), ckpt_path=ckpt_path)


def test_first_run_monitors_and_its_plain_callback_does_not(first_run: FirstRun) -> None:
    best = properties(first_run.monitored / "last.ortckpt")
    assert best["monitor"] == "val_loss"
    assert isinstance(best["monitor_value"], float)
    for path in _files(first_run.plain):  # saved after the monitored callback, in the same run
        assert not MONITOR & set(properties(path)), path.name


def test_resume_with_another_callback_writes_its_own_properties(
    mlp_adamw: Exported, first_run: FirstRun, tmp_path: Path
) -> None:
    """ORTCheckpoint(monitor="val_loss") first, then ORTCheckpoint(dirpath) alone from its last.ortckpt."""
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01, checkpoint=first_run.monitored / "last.ortckpt")
    _fit(module, tmp_path / "second", epochs=1)
    for path in _files(tmp_path / "second"):
        found = properties(path)
        assert not MONITOR & set(found), path.name
        assert found["global_step"] == (FIRST_EPOCHS + 1) * BATCHES
        assert found["epoch"] == FIRST_EPOCHS


def test_resume_from_lightning_ckpt_writes_its_own_properties(
    mlp_adamw: Exported, first_run: FirstRun, tmp_path: Path
) -> None:
    ckpt = first_run.lightning / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)["ort_state"]
    (tmp_path / "state.ortckpt").write_bytes(state.numpy().tobytes())
    assert properties(tmp_path / "state.ortckpt") == {}  # the .ckpt keeps the progress in its own record
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    _fit(module, tmp_path / "resumed", epochs=FIRST_EPOCHS + 1, ckpt_path=ckpt)
    for path in _files(tmp_path / "resumed"):
        found = properties(path)
        assert not MONITOR & set(found), path.name
        assert found["global_step"] == (FIRST_EPOCHS + 1) * BATCHES


def test_fleet_rounds_and_lightning_runs_keep_apart(mlp_adamw: Exported, first_run: FirstRun, tmp_path: Path) -> None:
    """A fleet server resumed from a Lightning run's file, then a Lightning run from the fleet's last round."""
    from ort_lightning.fleet.server.global_model import ROUND_PROPERTY, GlobalModel

    model = GlobalModel(mlp_adamw.artifacts, checkpoint=first_run.monitored / "last.ortckpt")
    model.load(model.arrays(), server_round=1)
    round_file = model.save(tmp_path / "round-0001.ortckpt")
    found = properties(round_file)
    assert found[ROUND_PROPERTY] == 1
    assert not (MONITOR | {"epoch", "next_epoch", "global_step"}) & set(found), found  # rounds, not steps

    _fit(ORTLightningModule(mlp_adamw.artifacts, lr=0.01, checkpoint=round_file), tmp_path / "after-fleet", epochs=1)
    for path in _files(tmp_path / "after-fleet"):
        assert ROUND_PROPERTY not in properties(path), path.name


def test_hybrid_run_writes_its_own_rate_and_no_schedule(
    mlp_adamw: Exported, first_run: FirstRun, tmp_path: Path
) -> None:
    first = properties(first_run.monitored / "last.ortckpt")
    assert set(first) >= SCHEDULE  # ORT's linear schedule, which the hybrid run does not run
    module = ORTLightningModule(mlp_adamw.artifacts, checkpoint=first_run.monitored / "last.ortckpt",
                                lr_scheduler="constant",
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    _fit(module, tmp_path / "hybrid", epochs=1)
    for path in _files(tmp_path / "hybrid"):
        found = properties(path)
        assert not (MONITOR | SCHEDULE) & set(found), path.name
        assert found["optimizer_state"] == 0
        assert found["lr"] == pytest.approx(0.05)


def test_save_outside_a_fit_keeps_where_the_run_started(mlp_adamw: Exported, first_run: FirstRun,
                                                        tmp_path: Path) -> None:
    start = first_run.monitored / "last.ortckpt"
    module = ORTLightningModule(mlp_adamw.artifacts, checkpoint=start)
    found = properties(module.save_ort_checkpoint(tmp_path / "again.ortckpt", properties={"note": "copy"}))
    assert not MONITOR & set(found)
    assert found["note"] == "copy"
    assert found["global_step"] == FIRST_EPOCHS * BATCHES
    assert found["next_epoch"] == FIRST_EPOCHS
    # the schedule this module resolved from the file (no fit has built one): the first run's, as it set it
    assert (found["schedule_lr"], found["schedule_total_steps"]) == ("0.01", 100)
    assert not SCHEDULE & set(properties(ORTLightningModule(mlp_adamw.artifacts, checkpoint=start, total_steps=None,
                                                             warmup_steps=0.1).save_ort_checkpoint(tmp_path / "b")))


def test_properties_are_replaced_only_in_an_ort_checkpoint_with_a_bag(mlp_adamw: Exported, tmp_path: Path) -> None:
    from ort_lightning.errors import CheckpointError
    from ort_lightning.ort.properties import replace_properties

    exported = tmp_path / "checkpoint"  # generate_artifacts writes no property bag
    exported.write_bytes(mlp_adamw.artifacts.checkpoint.read_bytes())
    replace_properties(exported, {})  # nothing to replace, nothing to add
    assert properties(exported) == {}
    with pytest.raises(CheckpointError, match=r"has no property bag to replace; save it from a state that holds"):
        replace_properties(exported, {"epoch": 1})
    other = tmp_path / "notes.txt"
    other.write_bytes(b"\xff\xff\xff\x7f not a flatbuffer")
    with pytest.raises(CheckpointError, match=r"notes\.txt is not an ONNX Runtime checkpoint \("):
        replace_properties(other, {"epoch": 1})
