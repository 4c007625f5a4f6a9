"""Shared fixtures: tiny torch models exported to real ORT artifacts once per test session."""

from __future__ import annotations

import copy
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from onnxruntime.training import onnxblock
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import TrainingArtifacts, export_artifacts

#: The thread variables as the test session found them: a test that starts Ray or a DDP launcher may set
#: them in this process for good, and the thread policy's tests need the environment the user gave.
THREAD_ENVIRONMENT = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


@pytest.fixture(autouse=True, scope="session")
def _quiet_lightning() -> Iterator[None]:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        yield


class SummedMSE(onnxblock.Block):
    """A custom loss block: MSE summed over every element against the input "target" (torch has no module for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = onnxblock.loss.MSELoss(reduction="sum")

    def build(self, output_name: str) -> str:
        return self.mse(output_name, "target")


class MLP(torch.nn.Module):
    """4 -> 8 -> 3 classifier."""

    def __init__(self, inputs: int = 4, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(inputs, hidden)
        self.fc2 = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class BNDropoutCNN(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU -> Dropout -> Linear on 1x8x8 images, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.fc(x.flatten(1))


@dataclass(frozen=True)
class Exported:
    """Artifacts plus a pristine copy of the torch model they came from (the reference)."""

    artifacts: TrainingArtifacts
    model: torch.nn.Module

    def reference(self) -> torch.nn.Module:
        return copy.deepcopy(self.model)


def _export(tmp: Path, name: str, model: torch.nn.Module, example: torch.Tensor, **options: object) -> Exported:
    pristine = copy.deepcopy(model)
    artifacts = export_artifacts(model, example, tmp / name, **options)  # type: ignore[arg-type]
    return Exported(artifacts, pristine)


@pytest.fixture(scope="session")
def artifacts_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="session")
def mlp_adamw(artifacts_root: Path) -> Exported:
    torch.manual_seed(0)
    return _export(artifacts_root, "mlp_adamw", MLP(), torch.zeros(2, 4))


@pytest.fixture(scope="session")
def mlp_sgd(artifacts_root: Path) -> Exported:
    torch.manual_seed(1)
    # NOTE: only mlp_adamw and bn_dropout_cnn are verified (tests/test_verify.py reads their reports); the tests
    # of mlp_sgd compare its steps with torch themselves.
    return _export(artifacts_root, "mlp_sgd", MLP(), torch.zeros(2, 4), optimizer="sgd", verify=False)


@pytest.fixture(scope="session")
def device_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[TrainingArtifacts, float], Path]:
    """The device folder of some artifacts at a rate (``prepare_for_web``'s, ``.onnx``), written once a session."""
    from ort_lightning.export import prepare_for_web

    made: dict[tuple[Path, float], Path] = {}

    def folder(artifacts: TrainingArtifacts, lr: float) -> Path:
        if (artifacts.directory, lr) not in made:
            output = tmp_path_factory.mktemp("device-folder") / "device"
            made[artifacts.directory, lr] = prepare_for_web(artifacts, output, lr=lr, ort_format=False).directory
        return made[artifacts.directory, lr]

    return folder


@pytest.fixture(scope="session")
def bn_dropout_cnn(artifacts_root: Path) -> Exported:
    torch.manual_seed(2)
    return _export(artifacts_root, "bn_dropout_cnn", BNDropoutCNN(), torch.zeros(2, 1, 8, 8))


def blobs(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three well-separated Gaussian blobs in 4-D: a linearly separable 3-class problem."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=generator)
    centers = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    x = centers[labels] + 0.5 * torch.randn(n, 4, generator=generator)
    return x, labels


@pytest.fixture
def blob_loaders() -> tuple[DataLoader, DataLoader]:
    x, y = blobs(512, seed=0)
    vx, vy = blobs(256, seed=1)
    train = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    val = DataLoader(TensorDataset(vx, vy), batch_size=64)
    return train, val


#: Set in this process by in-process Trainer runs under ort_ddp (Lightning's launcher writes them into
#: os.environ); a child process that inherits them takes itself for an already launched rank and never
#: starts its other ranks, so a later test that launches a DDP run would wait until its timeout.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _launch_variables_restored() -> Iterator[None]:
    """Give every test the process environment's launch variables as they were before it."""
    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
