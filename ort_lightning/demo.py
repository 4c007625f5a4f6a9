"""The demo's model and data: a small classifier for scikit-learn's bundled handwritten digits.

Nothing downloads: the 1,797 8x8 digit images ship inside scikit-learn.

Example::

    >>> data = DigitsDataModule(batch_size=32)
    >>> data.setup("fit")
    >>> x, y = next(iter(data.train_dataloader()))
    >>> tuple(x.shape), x.dtype, y.dtype
    ((32, 64), torch.float32, torch.int64)
    >>> digits_mlp()(x).shape
    torch.Size([32, 10])
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning.demo_data import STRIPE_CLASSES, split_digits, stripes

__all__ = ["DigitsDataModule", "StripesDataModule", "digits_mlp", "stripes_cnn"]

#: Inputs per image (8x8 pixels, flattened) and classes.
FEATURES = 64
CLASSES = 10


def digits_mlp(hidden: int = 64, seed: int = 0) -> torch.nn.Module:
    """Return a fresh 64 -> `hidden` -> 10 MLP for the digits, seeded for repeatable runs."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return torch.nn.Sequential(
            torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES)
        )
    finally:
        torch.random.set_rng_state(generator_state)


def stripes_cnn(channels: int = 8, seed: int = 0) -> torch.nn.Module:
    """Return a fresh small CNN for `StripesDataModule`'s 1x12x12 images: 4 classes, max pooling."""
    # NOTE: max, not average pooling: ORT's AveragePool gradient needs a fixed batch size.
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, channels, 3, padding=1), torch.nn.BatchNorm2d(channels), torch.nn.ReLU(),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1), torch.nn.BatchNorm2d(2 * channels), torch.nn.ReLU(),
            torch.nn.AdaptiveMaxPool2d(1), torch.nn.Flatten(), torch.nn.Linear(2 * channels, STRIPE_CLASSES),
        )
    finally:
        torch.random.set_rng_state(generator_state)


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's digits as ``(pixels float32 [B, 64] in [0, 1], label int64 [B])`` batches, split by `seed`."""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"Expected `val_fraction` in (0, 1), but got {val_fraction!r}.")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed

    def setup(self, stage: str) -> None:
        """Split the images once, the same way for every stage."""
        self.train_set, self.val_set = split_digits(self.val_fraction, self.seed)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches."""
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        """The held-out batches again."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out batches again (labels are ignored by predict)."""
        return self.val_dataloader()


class StripesDataModule(pl.LightningDataModule):
    """Generated images ``float32 [B, 1, 12, 12]`` of a stripe in one of 4 directions, labels ``int64 [B]``."""

    def __init__(self, batch_size: int = 32, train_size: int = 512, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_size = train_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        """Draw the images once, the same way for every stage."""
        self.train_set = TensorDataset(*stripes(self.train_size, self.seed))
        self.val_set = TensorDataset(*stripes(max(1, self.train_size // 4), self.seed + 1))

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (the last incomplete one dropped: BatchNorm needs 2+ samples)."""
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator,
                          drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches."""
        return DataLoader(self.val_set, batch_size=128)

    def test_dataloader(self) -> DataLoader:
        """The held-out batches again."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The held-out batches again (labels are ignored by predict)."""
        return self.val_dataloader()
