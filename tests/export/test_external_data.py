"""Weights as ONNX external data through the whole export: forced on small models, so that CI runs the path
a model over 2 GB takes (``benchmarks/large_model.py`` runs a real one)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.cli.console import main
from ort_lightning.export import external
from ort_lightning.export.source import load_source
from ort_lightning.export.verify import verifier
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort._api import CheckpointState
from tests.helpers import ROOT, quiet_trainer

STEPS = 3
LR = 0.01
BATCH = 8


class Tagger(torch.nn.Module):
    """Token ids -> 3 classes: a padded embedding (its legalization reads the weight's padding row), BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 8, padding_idx=0)
        self.fc1 = torch.nn.Linear(8, 8, bias=False)  # a bias before BatchNorm has a gradient of 0 + noise
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(self.embed(ids).mean(1)))))


class Regressor(torch.nn.Module):
    """4 -> 8 -> BatchNorm -> 3 outputs (its running statistics are buffers, kept outside the graph too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8, bias=False)
        self.bn = torch.nn.BatchNorm1d(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _batch(loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    if loss == "cross_entropy":
        ids = torch.randint(0, 12, (BATCH, 5), generator=generator)
        ids[:, -1] = 0  # the padding row is looked up, and must not train
        return ids, torch.randint(0, 3, (BATCH,), generator=generator)
    return torch.randn(BATCH, 4, generator=generator), torch.rand(BATCH, 3, generator=generator)


_TORCH_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
}


@dataclass
class Seen:
    """What ONNX Runtime's generator was handed, read while the work folder still existed."""

    external: dict[str, bool] = field(default_factory=dict)
    weights_file_bytes: int = 0
    graph_bytes: int = 0


@dataclass(frozen=True)
class Pair:
    """One model exported twice, weights outside the graph and inside, plus the pristine torch model."""

    model: torch.nn.Module
    external: TrainingArtifacts
    inline: TrainingArtifacts
    seen: Seen


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    root = tmp_path_factory.mktemp("external_data")
    generate = _ort.generate
    seen: dict[str, Seen] = {}
    current: list[str] = []

    def spy(model: onnx.ModelProto, **options: Any) -> None:
        # NOTE: counts and reads what the real generator gets; the generation itself is ONNX Runtime's.
        weights_dir = options.get("weights_dir")
        if weights_dir is not None:
            state = {*options["trainable"], *options["frozen"]}
            record = seen.setdefault(current[-1], Seen())
            record.external = {t.name: external.is_external(t) for t in model.graph.initializer if t.name in state}
            record.weights_file_bytes = (weights_dir / external.WEIGHTS_FILE).stat().st_size
            record.graph_bytes = model.ByteSize()
        generate(model, **options)

    pairs: dict[str, Pair] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_ort, "generate", spy)
        for loss in _TORCH_LOSSES:
            torch.manual_seed(3)
            model = Tagger() if loss == "cross_entropy" else Regressor()
            example, _ = _batch(loss)
            current.append(loss)
            on = export_artifacts(model, example[:4], root / f"{loss}-external", loss=loss, external_data=True)
            # NOTE: only the external export is verified; the inline one is held to it bit for bit below.
            off = export_artifacts(
                model, example[:4], root / f"{loss}-inline", loss=loss, external_data=False, verify=False
            )
            pairs[loss] = Pair(copy.deepcopy(model), on, off, seen.get(loss, Seen()))
    return pairs


def _state_bytes(model: torch.nn.Module) -> int:
    # NOTE: BatchNorm's num_batches_tracked is an int64 buffer the TorchScript exporter does not write.
    return sum(t.numel() * t.element_size() for name, t in model.state_dict().items() if "num_batches" not in name)


@pytest.mark.parametrize("loss", list(_TORCH_LOSSES))
def test_the_generator_gets_no_weights(exported: dict[str, Pair], loss: str) -> None:
    pair = exported[loss]
    state = {*pair.external.manifest.trainable, *pair.external.manifest.frozen, *pair.external.manifest.buffers}
    assert pair.seen.external == dict.fromkeys(state, True), "every parameter and buffer is external data"
    assert pair.seen.weights_file_bytes == _state_bytes(pair.model)
    assert not any(path.name.startswith(".weights-") for path in pair.external.directory.iterdir()), "work removed"
    assert pair.external.manifest.trainable == pair.inline.manifest.trainable


@pytest.mark.parametrize("loss", list(_TORCH_LOSSES))
def test_checkpoint_and_verification_match_the_inline_export(exported: dict[str, Pair], loss: str) -> None:
    pair = exported[loss]
    assert pair.external.manifest.verification is not None
    assert pair.external.manifest.verification["status"] == "passed"
    on = CheckpointState.load_checkpoint(str(pair.external.checkpoint)).parameters
    off = CheckpointState.load_checkpoint(str(pair.inline.checkpoint)).parameters
    state = dict(pair.model.state_dict())
    for name in pair.external.manifest.trainable + pair.external.manifest.buffers:
        torch.testing.assert_close(torch.from_numpy(on[name].data), torch.from_numpy(off[name].data), rtol=0, atol=0)
        torch.testing.assert_close(torch.from_numpy(on[name].data), state[name], rtol=0, atol=0, msg=name)


def _train_ort(artifacts: TrainingArtifacts, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")
    quiet_trainer(max_steps=STEPS).fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


def _train_torch(model: torch.nn.Module, loss: str, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)  # the artifacts' AdamW defaults are torch's
    for batch, labels in zip(x.split(BATCH), y.split(BATCH), strict=True):
        optimizer.zero_grad()
        _TORCH_LOSSES[loss](reference(batch), labels).backward()
        optimizer.step()
    return dict(reference.named_parameters())


@pytest.mark.parametrize("loss", list(_TORCH_LOSSES))
def test_trainer_steps_match_torch_and_the_inline_export(exported: dict[str, Pair], loss: str) -> None:
    pair = exported[loss]
    x, y = (torch.cat([t] * STEPS) for t in _batch(loss))
    on, off = _train_ort(pair.external, x, y), _train_ort(pair.inline, x, y)
    expected = _train_torch(pair.model, loss, x, y)
    for name, parameter in expected.items():
        torch.testing.assert_close(on[name], off[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(on[name], parameter.detach(), rtol=1e-5, atol=1e-5, msg=name)
    moved = max(float((on[n] - p.detach()).abs().max()) for n, p in pair.model.named_parameters())
    assert moved > 1e-3, "training moved the weights"
    if loss == "cross_entropy":
        torch.testing.assert_close(on["embed.weight"][0], pair.model.embed.weight[0].detach(), rtol=0, atol=0)


def test_source_stage_keeps_every_weight_in_the_work_folder(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = Regressor()
    proto, parameters, buffers = load_source(model, torch.randn(4, 4), None, False, weights_dir=tmp_path)
    state = {t.name: t for t in proto.graph.initializer if t.name in parameters | buffers}
    assert sorted(state) == sorted(name for name in model.state_dict() if "num_batches" not in name)
    assert all(external.is_external(t) and not t.raw_data for t in state.values())
    assert (tmp_path / external.WEIGHTS_FILE).stat().st_size == _state_bytes(model)
    for name, tensor in state.items():
        value = torch.from_numpy(external.read_array(tensor, tmp_path).copy())
        torch.testing.assert_close(value, model.state_dict()[name], rtol=0, atol=0, msg=name)
    assert proto.ByteSize() < 4096


def test_onnx_file_with_external_data_exports_through_the_work_folder(tmp_path: Path) -> None:
    torch.manual_seed(6)
    model = Regressor().eval()
    proto, _, _ = load_source(model, torch.randn(4, 4), None, False)
    source = tmp_path / "source"
    source.mkdir()
    onnx.save(proto, source / "model.onnx", save_as_external_data=True, location="model.data", size_threshold=0)
    written = onnx.load(source / "model.onnx", load_external_data=False).graph.initializer
    assert all(external.is_external(tensor) for tensor in written)
    artifacts = export_artifacts(
        source / "model.onnx", output_dir=tmp_path / "artifacts", loss="mse", external_data=True
    )
    assert artifacts.manifest.verification is not None
    assert artifacts.manifest.verification["status"] == "no torch reference"
    parameters = CheckpointState.load_checkpoint(str(artifacts.checkpoint)).parameters
    for name, tensor in model.state_dict().items():
        if name in artifacts.manifest.trainable:
            torch.testing.assert_close(torch.from_numpy(parameters[name].data), tensor, rtol=0, atol=0, msg=name)
    assert sorted(p.name for p in source.iterdir()) == ["model.data", "model.onnx"], "the source is left alone"


def test_the_automatic_switch_and_the_verification_limit_for_large_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Regressor()
    assert external.external_data_wanted(model, None), "a torch module takes the no-copy path at any size"
    assert not external.external_data_wanted(model, False)
    proto, _, _ = load_source(model.eval(), torch.randn(4, 4), None, False)
    assert not external.external_data_wanted(proto, None), "a small ONNX source keeps its weights in the graph"
    monkeypatch.setattr(external, "AUTO_BYTES", _state_bytes(model) - 1)
    assert external.external_data_wanted(proto, None)
    # NOTE: the limit lowered to 0 bytes stands in for a model over 1 GiB of weights.
    monkeypatch.setattr(verifier, "REFERENCE_LIMIT_BYTES", 0)
    artifacts = export_artifacts(model, torch.randn(4, 4), tmp_path / "large", loss="mse", external_data=True)
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "no torch reference"
    assert re.match(r"0\.0 GiB of weights, over the 0 GiB for which torch's float64 reference", report["reason"])
    assert main(["inspect", str(artifacts.directory)]) == 0
    assert re.search(r"verified:\s+no torch reference \(0\.0 GiB of weights, over", capsys.readouterr().out)


@pytest.mark.slow  # a child process: the benchmark's own script
def test_large_model_benchmark_runs_in_its_quick_mode() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.large_model", "--quick"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for stage in ("build the torch model", "export_artifacts", "train 3 AdamW steps"):
        assert re.search(rf"^\| {stage}[^|]* \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", result.stdout, re.M), stage
