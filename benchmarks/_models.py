"""The benchmarked models and their data: generated tensors, nothing downloads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode


def small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def compute_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions and a linear head on 1x28x28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(16 * 14 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


@dataclass(frozen=True)
class Case:
    """One benchmarked model: how to build it, its input shape and its batch size."""

    name: str
    factory: Callable[[], torch.nn.Module]
    input_shape: tuple[int, ...]
    batch_size: int

    def model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.factory()

    def example(self) -> torch.Tensor:
        return torch.zeros(2, *self.input_shape)

    def loader(self, steps: int, seed: int = 0) -> DataLoader:
        """A DataLoader of exactly `steps` batches of random inputs and class labels."""
        generator = torch.Generator().manual_seed(seed)
        n = steps * self.batch_size
        x = torch.randn(n, *self.input_shape, generator=generator)
        y = torch.randint(0, 10, (n,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)

    def train_flops(self) -> float:
        """Forward + backward FLOPs of one batch, counted by torch's FlopCounterMode."""
        model = self.model()
        x = torch.randn(self.batch_size, *self.input_shape)
        y = torch.randint(0, 10, (self.batch_size,))
        counter = FlopCounterMode(display=False)
        with counter:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        return float(counter.get_total_flops())


CASES = {
    "mlp-small": Case("mlp-small", small_mlp, (784,), 64),
    "mlp-compute": Case("mlp-compute", compute_mlp, (784,), 256),
    "cnn-small": Case("cnn-small", SmallCNN, (1, 28, 28), 64),
}
