"""ONNX-file sources train their real weights only, as the same torch model trains its parameters."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.cli import main
from ort_lightning.ort.runtime import checkpoint_summary
from tests.conftest import blobs
from tests.helpers import quiet_trainer

STEPS, LR = 10, 0.05
CONSTANTS = ["cap", "exponent", "half"]


class Scaled(torch.nn.Module):
    """``out(clamp((relu(fc1(x)) * 0.5) ** 2, max=3))``: three constants between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.clamp((torch.relu(self.fc1(x)) * 0.5) ** 2, max=3.0))


def _as_onnx(model: Scaled) -> onnx.ModelProto:
    """The graph an exporter writes when it keeps constants as initializers (a scalar Mul factor...)."""
    weights = [numpy_helper.from_array(t.detach().numpy(), name) for name, t in model.named_parameters()]
    constants = [
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array([2.0], np.float32), "exponent"),  # rank 1, but a Pow exponent
        numpy_helper.from_array(np.array(3.0, np.float32), "cap"),
    ]
    nodes = [
        helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Mul", ["r", "half"], ["m"]),
        helper.make_node("Pow", ["m", "exponent"], ["p"]),
        helper.make_node("Clip", ["p", "", "cap"], ["c"]),
        helper.make_node("Gemm", ["c", "out.weight", "out.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes, "scaled", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], weights + constants,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scaled, Path]:
    torch.manual_seed(11)
    model = Scaled()
    folder = tmp_path_factory.mktemp("onnx_source")
    onnx.save(_as_onnx(model), folder / "scaled.onnx")
    export_artifacts(folder / "scaled.onnx", output_dir=folder / "artifacts", verify=False)
    return model, folder / "artifacts"


def test_only_real_weights_train(scaled: tuple[Scaled, Path]) -> None:
    model, artifacts = scaled
    parameters, _ = checkpoint_summary(artifacts / "checkpoint")
    assert sorted(name for name, _, _ in parameters) == sorted(name for name, _ in model.named_parameters())
    module = ORTLightningModule(artifacts)
    assert sorted(module.artifacts.manifest.trainable) == sorted(name for name, _ in model.named_parameters())
    x, _ = blobs(8, seed=12)
    torch.testing.assert_close(module(x), model(x).detach(), rtol=1e-5, atol=1e-6)


def test_training_matches_the_torch_model(scaled: tuple[Scaled, Path]) -> None:
    model, artifacts = scaled
    x, y = blobs(STEPS * 16, seed=13)
    module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")
    quiet_trainer(max_steps=STEPS).fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)  # the artifacts' AdamW defaults are torch's
    for batch, labels in zip(x.split(16), y.split(16), strict=True):
        optimizer.zero_grad()
        F.cross_entropy(reference(batch), labels).backward()
        optimizer.step()
    trained = dict(module.named_parameters())
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(trained[name].detach(), parameter.detach(), rtol=1e-5, atol=1e-5, msg=name)
    assert not torch.allclose(trained["out.weight"], model.out.weight, atol=1e-3), "training moved the weights"
    # The constants are still what the graph says: the forward equals torch's with the same weights.
    torch.testing.assert_close(module(x), reference(x).detach(), rtol=1e-4, atol=1e-5)


def test_inspect_lists_weights_and_constants(scaled: tuple[Scaled, Path], capsys: pytest.CaptureFixture[str]) -> None:
    _, artifacts = scaled
    assert main(["inspect", str(artifacts)]) == 0
    shown = capsys.readouterr().out
    # NOTE: inspect aligns its values on the longest key, which depends on the rows a folder has.
    assert re.search(r"^trains: +fc1\.bias, fc1\.weight, out\.bias, out\.weight$", shown, re.M)
    assert re.search(rf"^constants: +{re.escape(', '.join(CONSTANTS))}$", shown, re.M)
