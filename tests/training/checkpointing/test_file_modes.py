"""ORT checkpoints, their ``.sha256`` sidecars and inference models get the umask's mode, as torch.save's do."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ort_lightning import ORTLightningModule
from ort_lightning.storage.atomic import digest_path
from tests.conftest import Exported


@pytest.fixture(params=[0o022, 0o027], ids=["umask-022", "umask-027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_written_files_follow_the_umask(umask: int, mlp_adamw: Exported, tmp_path: Path) -> None:
    reference = tmp_path / "reference.pt"
    torch.save({"w": torch.zeros(1)}, reference)  # the independent reference: torch's own file mode
    module = ORTLightningModule(mlp_adamw.artifacts)
    checkpoint = module.save_ort_checkpoint(tmp_path / "last.ortckpt")
    inference = module.export_inference_model(tmp_path / "model.onnx")
    expected = _mode(reference)
    assert expected == 0o666 & ~umask
    assert {path.name: _mode(path) for path in (checkpoint, digest_path(checkpoint), inference)} == {
        "last.ortckpt": expected, "last.ortckpt.sha256": expected, "model.onnx": expected,
    }
