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
from ort_lightning.artifacts import TensorSpec
from ort_lightning.artifacts.state import flat_values
from ort_lightning.errors import CheckpointError, ConfigurationError
from tests.artifacts.generated import BATCH, LR, Net, lightning_fit
from tests.helpers import ROOT, ort_device_loop


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
    on_onnx = ort_device_loop(_only(device_ready.directory, ".onnx", tmp_path), batches, lr=LR, checkpoint=trained)
    on_ort = ort_device_loop(_only(device_ready.directory, ".ort", tmp_path), batches, lr=LR, checkpoint=trained)
    for name, value in on_onnx.items():
        np.testing.assert_allclose(on_ort[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_round_trip_lightning_then_device_equals_lightning(device_ready: TrainingArtifacts, tmp_path: Path) -> None:
    """Lightning 3 steps, then ORT's loop on the .ort graphs 2 steps == Lightning 5 steps."""
    batches = _batches(5)
    first = ORTLightningModule(device_ready, lr=LR, lr_scheduler="constant")
    lightning_fit(first, batches[:3])
    handed = first.save_ort_checkpoint(tmp_path / "last.ortckpt")
    device = ort_device_loop(_only(device_ready.directory, ".ort", tmp_path), batches[3:], checkpoint=handed, lr=LR)
    whole = ORTLightningModule(device_ready, lr=LR, lr_scheduler="constant")
    lightning_fit(whole, batches)
    for name, tensor in whole.named_parameters():
        np.testing.assert_allclose(device[name], tensor.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)


def _received(artifacts: TrainingArtifacts) -> dict[str, torch.Tensor]:
    """Weights a device receives (a server's): the initial ones moved, so that they are not the folder's."""
    generator = torch.Generator().manual_seed(11)
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    return {name: torch.from_numpy(np.array(p.data)) + 0.3 * torch.randn(p.data.shape, generator=generator)
            for name, p in state.parameters}


def test_nominal_checkpoint_needs_weights(device_ready: TrainingArtifacts) -> None:
    nominal = device_ready.nominal_checkpoint
    assert nominal is not None
    with pytest.raises(CheckpointError, match=r"is a nominal checkpoint \(names and shapes, no weights.*pass the "
                                              r"weights with ORTLightningModule\(\.\.\., checkpoint=nominal, values="):
        ORTLightningModule(device_ready, checkpoint=nominal)
    values = _received(device_ready)
    with pytest.raises(ConfigurationError, match=r"\['fc2.bias'\] are missing"):
        ORTLightningModule(device_ready, checkpoint=nominal, values={k: values[k] for k in values if k != "fc2.bias"})
    with pytest.raises(ConfigurationError, match=r"Expected value 'fc1.bias' of shape \(5,\), but got \(3,\)"):
        ORTLightningModule(device_ready, checkpoint=nominal, values={**values, "fc1.bias": torch.zeros(3)})


def test_nominal_checkpoint_of_another_model_and_non_float_state_are_refused(
    device_ready: TrainingArtifacts, tmp_path: Path
) -> None:
    other = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tmp_path / "other", verify=False,
                             nominal_checkpoint=True)
    assert other.nominal_checkpoint is not None
    with pytest.raises(CheckpointError, match=r"names the parameters \['bias', 'weight'\], but the training graph"):
        ORTLightningModule(device_ready, checkpoint=other.nominal_checkpoint, values=_received(device_ready))
    counter = TensorSpec("num_batches_tracked", "int64", ())
    with pytest.raises(ConfigurationError, match=r"state tensors \['num_batches_tracked \(int64\)'\] are not float32"):
        flat_values({"num_batches_tracked": torch.tensor(3)}, [counter])


def test_device_files_from_nominal_checkpoint_and_received_weights_equal_orts_loop(
    device_ready: TrainingArtifacts, tmp_path: Path
) -> None:
    """Only .ort graphs and the weightless checkpoint, plus weights received: Lightning == ORT's loop from them."""
    device = _only(device_ready.directory, ".ort", tmp_path)
    values = _received(device_ready)
    batches = _batches(3)
    module = ORTLightningModule(device, checkpoint=device / "nominal_checkpoint", values=values, lr=LR,
                                lr_scheduler="constant")
    for name, tensor in module.named_parameters():
        assert torch.equal(tensor.detach(), values[name].float()), name
    lightning_fit(module, batches)
    reference = ort_device_loop(device_ready.directory, batches, lr=LR, graphs="ort", values=values)
    for name, tensor in module.named_parameters():
        assert not np.allclose(reference[name], values[name].numpy(), atol=1e-3), f"{name} did not train"
        np.testing.assert_allclose(tensor.detach().numpy(), reference[name], rtol=0, atol=1e-6, err_msg=name)
    # what it saves is a complete checkpoint: ORT reads every weight back
    saved = CheckpointState.load_checkpoint(str(module.save_ort_checkpoint(tmp_path / "trained.ortckpt")))
    for name, tensor in module.named_parameters():
        np.testing.assert_array_equal(saved.parameters[name].data, tensor.detach().numpy(), err_msg=name)


@pytest.mark.slow  # a child process
def test_readme_round_trip_runs_as_written() -> None:
    section = (ROOT / "docs" / "device.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True"
