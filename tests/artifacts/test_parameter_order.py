"""``named_parameters()`` in the torch model's own order, so that code zipping the two lists works."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.artifacts import MANIFEST_NAME
from tests.conftest import Exported


class Unsorted(torch.nn.Module):
    """Submodules whose names sort otherwise than they are defined, a BatchNorm, a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.zeta = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.alpha = torch.nn.Linear(8, 3)
        self.zeta.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha(torch.relu(self.norm(self.zeta(x))))


def test_named_parameters_and_buffers_zip_with_the_torch_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Unsorted()
    module = ORTLightningModule(export_artifacts(model, torch.zeros(2, 4), tmp_path / "art", verify=False))
    pairs = list(zip(module.named_parameters(), model.named_parameters(), strict=True))
    assert [ours for (ours, _), _ in pairs] == [name for name, _ in model.named_parameters()]
    for (_, ours), (_, theirs) in pairs:
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=0)
        assert ours.requires_grad == theirs.requires_grad
    expected_buffers = [name for name, _ in model.named_buffers() if not name.endswith("num_batches_tracked")]
    assert [name for name, _ in module.named_buffers()] == expected_buffers


def test_a_manifest_without_the_order_keeps_onnx_runtimes(mlp_adamw: Exported, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(mlp_adamw.artifacts.directory, tmp_path / "old"))
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    del manifest["parameter_order"]
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    module = ORTLightningModule(TrainingArtifacts.load(folder))
    assert [name for name, _ in module.named_parameters()] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
