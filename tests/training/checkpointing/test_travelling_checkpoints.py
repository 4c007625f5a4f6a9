"""Lightning ``.ckpt`` files that travel: found again beside the checkpoint, checked against the artifacts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.errors import CheckpointError
from tests.conftest import MLP, Exported
from tests.helpers import quiet_trainer


def _trained_ckpt(artifacts: object, loader: DataLoader, path: Path, **options: object) -> ORTLightningModule:
    module = ORTLightningModule(artifacts, lr=1e-2, **options)  # type: ignore[arg-type]
    trainer = quiet_trainer(max_steps=3, accelerator="cpu")
    trainer.fit(module, loader)
    trainer.save_checkpoint(path)
    return module


def test_a_moved_run_finds_its_artifacts_beside_the_checkpoint(
    mlp_adamw: Exported, blob_loaders: tuple[DataLoader, DataLoader], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(mlp_adamw.artifacts.directory, run / "art")
    monkeypatch.chdir(run)
    trained = _trained_ckpt("art", blob_loaders[0], run / "checkpoints" / "last.ckpt")
    moved = Path(shutil.move(run, tmp_path / "elsewhere"))
    monkeypatch.chdir(tmp_path)
    loaded = ORTLightningModule.load_from_checkpoint(moved / "checkpoints" / "last.ckpt")
    assert loaded.artifacts.directory == moved / "art"
    for (name, ours), (_, theirs) in zip(loaded.named_parameters(), trained.named_parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    shutil.rmtree(moved / "art")
    with pytest.raises(CheckpointError, match=r"was trained on the artifacts folder 'art', which exists neither as "
                                              r"written nor beside the checkpoint .*artifacts=<that folder>\)"):
        ORTLightningModule.load_from_checkpoint(moved / "checkpoints" / "last.ckpt")


@pytest.fixture(scope="module")
def wider(tmp_path_factory: pytest.TempPathFactory) -> TrainingArtifacts:
    torch.manual_seed(3)
    return export_artifacts(MLP(hidden=12), torch.zeros(2, 4), tmp_path_factory.mktemp("wider") / "art", verify=False)


@pytest.mark.parametrize(
    ("other", "message"),
    [("wider", r"its parameters are .*different \['fc1\.bias: \[8\] vs \[12\]'"),
     ("sgd", r"its optimizer is 'adamw', the artifacts' is 'sgd'")],
    ids=["another-model", "another-optimizer"],
)
def test_a_checkpoint_onto_other_artifacts_is_refused_as_checkpoint_does(
    mlp_adamw: Exported, mlp_sgd: Exported, wider: TrainingArtifacts, blob_loaders: tuple[DataLoader, DataLoader],
    tmp_path: Path, other: str, message: str,
) -> None:
    _trained_ckpt(mlp_adamw.artifacts, blob_loaders[0], tmp_path / "a.ckpt")
    folder = (wider if other == "wider" else mlp_sgd.artifacts).directory
    expected = rf"^The Lightning checkpoint does not match the artifacts in .*{message}.*pass a checkpoint written"
    with pytest.raises(CheckpointError, match=expected):
        ORTLightningModule.load_from_checkpoint(tmp_path / "a.ckpt", artifacts=folder)


def test_metrics_are_asked_for_again_by_name(
    mlp_adamw: Exported, blob_loaders: tuple[DataLoader, DataLoader], tmp_path: Path
) -> None:
    _trained_ckpt(mlp_adamw.artifacts, blob_loaders[0], tmp_path / "m.ckpt",
                  metrics={"acc": MulticlassAccuracy(num_classes=3)})
    with pytest.raises(CheckpointError, match=r"was trained with metrics \{'acc': MulticlassAccuracy\(\.\.\.\)\}, "
                                              r"which a checkpoint cannot rebuild; pass them again"):
        ORTLightningModule.load_from_checkpoint(tmp_path / "m.ckpt")
    loaded = ORTLightningModule.load_from_checkpoint(tmp_path / "m.ckpt", metrics={"acc": MulticlassAccuracy(3)})
    assert "train_metrics" in dict(loaded.named_children())


def test_a_checkpoint_written_before_the_identity_is_still_checked_by_its_parameters(
    mlp_adamw: Exported, wider: TrainingArtifacts, blob_loaders: tuple[DataLoader, DataLoader], tmp_path: Path
) -> None:
    _trained_ckpt(mlp_adamw.artifacts, blob_loaders[0], tmp_path / "a.ckpt")
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    del checkpoint["ort_lightning_artifacts"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(CheckpointError, match=r"does not match the artifacts in .*different \['fc1\.bias: \[8\] vs "
                                              r"\[12\]'"):
        ORTLightningModule.load_from_checkpoint(tmp_path / "old.ckpt", artifacts=wider.directory)
    loaded = ORTLightningModule.load_from_checkpoint(tmp_path / "old.ckpt", artifacts=mlp_adamw.artifacts.directory)
    assert loaded.artifacts.directory == mlp_adamw.artifacts.directory
