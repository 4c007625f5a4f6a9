"""``export_artifacts(..., ort_format=True, nominal_checkpoint=True)`` writes what a device ships, and the round trip.

The reference on the device side is ONNX Runtime's documented loop (``CheckpointState`` /
``Module`` / ``Optimizer``) run on the ``.ort`` graphs; it must give what it gives on the ``.onnx``
graphs, and the loop continues a Lightning run exactly once the device sets its learning rate.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from tests.test_adopt import BATCH, LR, Net, lightning_fit, ort_loop


@pytest.fixture(scope="module")
def device_ready(tmp_path_factory: pytest.TempPathFactory) -> TrainingArtifacts:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("device") / "artifacts"
    return export_artifacts(Net(), torch.zeros(2, 4), folder, verify=False, ort_format=True, nominal_checkpoint=True)


def _batches(count: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 4, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(count)]


def _only(folder: Path, suffix: str, tmp_path: Path) -> Path:
    """A copy of the device files with one graph format, as a device holds them."""
    copy = tmp_path / suffix.strip(".")
    copy.mkdir()
    for path in folder.iterdir():
        if path.suffix in (suffix, "") and path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    return copy


def test_device_files_are_written(device_ready: TrainingArtifacts) -> None:
    names = {path.name for path in device_ready.directory.iterdir()}
    assert {"training_model.ort", "eval_model.ort", "optimizer_model.ort", "nominal_checkpoint"} <= names
    nominal = CheckpointState.load_checkpoint(str(device_ready.directory / "nominal_checkpoint"))
    with pytest.raises(RuntimeError, match="nominal state"):
        nominal.parameters["fc1.weight"]  # noqa: B018 - reading it is the check: no weights in a nominal checkpoint
    assert (device_ready.directory / "nominal_checkpoint").stat().st_size < device_ready.checkpoint.stat().st_size


def test_ort_loop_on_ort_graphs_equals_onnx_graphs(device_ready: TrainingArtifacts, tmp_path: Path) -> None:
    module = ORTLightningModule(device_ready, lr=LR, lr_scheduler="constant")
    lightning_fit(module, _batches(2))
    trained = module.save_ort_checkpoint(tmp_path / "last.ortckpt")
    batches = _batches(5)[2:]
    on_onnx = ort_loop(_only(device_ready.directory, ".onnx", tmp_path), batches, checkpoint=trained)
    on_ort = ort_loop(_only(device_ready.directory, ".ort", tmp_path), batches, checkpoint=trained)
    for name, value in on_onnx.items():
        np.testing.assert_allclose(on_ort[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_round_trip_lightning_then_device_equals_lightning(device_ready: TrainingArtifacts, tmp_path: Path) -> None:
    """Lightning 3 steps, then ORT's loop on the .ort graphs 2 steps == Lightning 5 steps."""
    batches = _batches(5)
    first = ORTLightningModule(device_ready, lr=LR, lr_scheduler="constant")
    lightning_fit(first, batches[:3])
    handed = first.save_ort_checkpoint(tmp_path / "last.ortckpt")
    device = ort_loop(_only(device_ready.directory, ".ort", tmp_path), batches[3:], checkpoint=handed, lr=LR)
    whole = ORTLightningModule(device_ready, lr=LR, lr_scheduler="constant")
    lightning_fit(whole, batches)
    for name, tensor in whole.named_parameters():
        np.testing.assert_allclose(device[name], tensor.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_readme_round_trip_runs_as_written() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## From Lightning to the device and back", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True"
