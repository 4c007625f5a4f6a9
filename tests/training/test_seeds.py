"""ORT's random stream (Dropout) follows Lightning's seed and survives both kinds of resume bit for bit."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from tests.conftest import Exported
from tests.helpers import quiet_trainer
from tests.strategies import ddp_run

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
]

PER_EPOCH, SCHEDULE = 4, dict(lr=0.01, warmup_steps=2, total_steps=8)


def _loader() -> DataLoader:
    x, y = ddp_run.dataset("cnn", 8 * PER_EPOCH)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _trainer(root: Path, **options: object) -> L.Trainer:
    return quiet_trainer(**{"accelerator": "cpu", "default_root_dir": root, **options})


def _state(module: ORTLightningModule) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _fit(exported: Exported, root: Path, seed: int, epochs: int = 2) -> dict[str, torch.Tensor]:
    L.seed_everything(seed, verbose=False)
    module = ORTLightningModule(exported.artifacts, **SCHEDULE)
    _trainer(root, max_epochs=epochs).fit(module, _loader())
    return _state(module)


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_seeded_fits_are_reproducible_and_the_seed_reaches_dropout(bn_dropout_cnn: Exported, tmp_path: Path) -> None:
    first, again = _fit(bn_dropout_cnn, tmp_path, seed=3), _fit(bn_dropout_cnn, tmp_path, seed=3)
    assert _identical(first, again)
    # the control: same data, weights and order, another seed: only Dropout's masks differ
    assert not _identical(first, _fit(bn_dropout_cnn, tmp_path, seed=4))


@pytest.fixture
def straight(bn_dropout_cnn: Exported, tmp_path: Path) -> dict[str, torch.Tensor]:
    return _fit(bn_dropout_cnn, tmp_path / "straight", seed=11)


def test_ckpt_path_resume_of_a_dropout_model_is_bit_identical(
    bn_dropout_cnn: Exported, straight: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    L.seed_everything(11, verbose=False)
    first = ORTLightningModule(bn_dropout_cnn.artifacts, **SCHEDULE)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[saver]).fit(first, _loader())
    L.seed_everything(11, verbose=False)
    resumed = ORTLightningModule(bn_dropout_cnn.artifacts, **SCHEDULE)
    _trainer(tmp_path, max_epochs=2).fit(resumed, _loader(), ckpt_path=tmp_path / "last.ckpt")
    assert _identical(_state(resumed), straight)


def test_checkpoint_file_resume_of_a_dropout_model_is_bit_identical_without_seeding_again(
    bn_dropout_cnn: Exported, straight: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    L.seed_everything(11, verbose=False)
    first = ORTLightningModule(bn_dropout_cnn.artifacts, **SCHEDULE)
    _trainer(tmp_path, max_epochs=1, callbacks=[ORTCheckpoint(tmp_path)]).fit(first, _loader())
    # a new process that never calls seed_everything: the seed comes from the checkpoint
    monkeypatch.delenv("PL_GLOBAL_SEED")
    torch.manual_seed(12345)
    resumed = ORTLightningModule(bn_dropout_cnn.artifacts, checkpoint=tmp_path / "last.ortckpt")
    _trainer(tmp_path, max_epochs=1).fit(resumed, _loader())
    assert _identical(_state(resumed), straight)
    # the control: the same resume with another ORT seed lands elsewhere
    stored = ORTLightningModule(bn_dropout_cnn.artifacts, checkpoint=tmp_path / "last.ortckpt")
    reseeded = stored.save_ort_checkpoint(tmp_path / "reseeded.ortckpt", properties={"seed": stored.seed + 1})
    other = ORTLightningModule(bn_dropout_cnn.artifacts, checkpoint=reseeded)
    assert other.seed == stored.seed + 1
    assert other.start_progress == stored.start_progress
    _trainer(tmp_path, max_epochs=1).fit(other, _loader())
    assert not _identical(_state(other), straight)


def test_an_unseeded_process_seed_of_64_bits_is_kept_by_a_checkpoint(
    mlp_adamw: Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's initial seed of an unseeded process may use all 64 bits; ORT stores signed 64-bit ints
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    torch.manual_seed(2**64 - 5)
    module = ORTLightningModule(mlp_adamw.artifacts)
    path = module.save_ort_checkpoint(tmp_path / "state.ortckpt")
    assert ORTLightningModule(mlp_adamw.artifacts, checkpoint=path).seed == module.seed == 2**63 - 5
