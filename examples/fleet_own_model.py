"""A model and a data module of one's own, for examples/fleet_own_model.yaml (the fleet trains both).

`mlp` is a torch module factory; `BreastCancer` is a LightningDataModule over scikit-learn's
bundled breast-cancer set (569 examples, 30 features, 2 classes; nothing downloads). The fleet
cuts its training set into the devices and measures the global model on its validation set.
"""

from __future__ import annotations

import lightning as L
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def mlp(features: int = 30, hidden: int = 32, classes: int = 2) -> nn.Module:
    """A small classifier; the fleet exports it once, under the config's seed."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class BreastCancer(L.LightningDataModule):
    """Standardized features and labels, 80 % to train (the devices), 20 % held out (the server)."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str | None = None) -> None:
        x, y = load_breast_cancer(return_X_y=True)
        x = torch.as_tensor(x, dtype=torch.float32)
        x = (x - x.mean(0)) / x.std(0)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        cut = int(0.8 * len(x))
        rows = {"train": order[:cut], "val": order[cut:]}
        self.sets = {name: TensorDataset(x[r], torch.as_tensor(y, dtype=torch.int64)[r]) for name, r in rows.items()}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=256)
