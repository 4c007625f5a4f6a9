"""BatchNorm running statistics against torch's own BatchNorm trained by a plain torch loop."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts
from tests.helpers import quiet_trainer

STEPS, BATCH, LR = 12, 8, 0.1


class BN1d(torch.nn.Module):
    """BatchNorm1d on the input (statistics of the data alone), then one after a trained layer."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_in = torch.nn.BatchNorm1d(4)
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(self.bn_in(x)))))


class BN2d(torch.nn.Module):
    """BatchNorm2d on 2x6x6 images, a convolution, BatchNorm2d again, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.bn_in = torch.nn.BatchNorm2d(2)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.out = torch.nn.Linear(3 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.conv(self.bn_in(x)))).flatten(1))


def _data(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(STEPS * BATCH, *shape, generator=generator) + 0.5
    return x, torch.randint(0, 3, (STEPS * BATCH,), generator=generator)


def _torch_loop(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    model.train()
    # NOTE: SGD, not AdamW: a bias followed by BatchNorm has a zero gradient up to float noise, which
    # AdamW's normalization would turn into lr-sized steps that differ between any two libraries.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for batch, labels in zip(x.split(BATCH), y.split(BATCH), strict=True):
        optimizer.zero_grad()
        F.cross_entropy(model(batch), labels).backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module", params=["1d", "2d"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(7)
    model, shape = (BN1d(), (4,)) if request.param == "1d" else (BN2d(), (2, 6, 6))
    x, y = _data(shape, seed=8)
    artifacts = export_artifacts(copy.deepcopy(model), torch.zeros(2, *shape), tmp_path_factory.mktemp("bn"),
                                 optimizer="sgd", verify=False)
    module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")
    quiet_trainer(max_steps=STEPS).fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return module, _torch_loop(model, x, y), x, shape


def _population_update(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """ONNX's (and ORT's kernel's) rule on the input BatchNorm: the batch's biased variance."""
    running = torch.ones(x.shape[1])
    for batch in x.split(BATCH):
        running = 0.9 * running + 0.1 * batch.var(dim=dims, unbiased=False)
    return running


def test_running_statistics_equal_torch(trained) -> None:
    module, reference, x, shape = trained
    buffers = dict(module.named_buffers())
    # The input BatchNorm sees the data alone: its statistics are torch's to float rounding.
    torch.testing.assert_close(buffers["bn_in.running_var"], reference.bn_in.running_var, rtol=1e-6, atol=0)
    torch.testing.assert_close(buffers["bn_in.running_mean"], reference.bn_in.running_mean, rtol=1e-6, atol=1e-7)
    # After a trained layer they also carry 12 SGD steps of float drift (ORT vs torch: ~1e-6).
    torch.testing.assert_close(buffers["bn.running_var"], reference.bn.running_var, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buffers["bn.running_mean"], reference.bn.running_mean, rtol=1e-5, atol=1e-6)
    # The control: the population-variance rule is measurably elsewhere (factor n / (n - 1)).
    dims = (0,) if len(shape) == 1 else (0, 2, 3)
    biased = _population_update(x, dims)
    assert not torch.allclose(biased, reference.bn_in.running_var, rtol=1e-3)


def test_validation_and_inference_model_equal_torch(trained, tmp_path: Path) -> None:
    module, reference, _, shape = trained
    x, y = _data(shape, seed=9)
    with torch.no_grad():
        logits = reference(x)
    result = quiet_trainer().validate(
        module, DataLoader(TensorDataset(x, y), batch_size=len(x)), verbose=False
    )[0]
    assert result["val_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    path = module.export_inference_model(tmp_path / "model.onnx")
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {"input": x.numpy()})
    np.testing.assert_allclose(exported, logits.numpy(), rtol=1e-4, atol=1e-5)
