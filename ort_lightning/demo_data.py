"""The demo's data as tensors, without Lightning: what a device that has no ``Trainer`` loads.

Nothing downloads: the 1,797 8x8 digit images ship inside scikit-learn, and the stripes are
drawn from a seeded generator. `ort_lightning.demo`'s data modules hold these same splits.

Example::

    >>> train, held_out = split_digits(val_fraction=0.2, seed=0)
    >>> len(train), len(held_out)
    (1438, 359)
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

__all__ = ["STRIPE_CLASSES", "STRIPE_SHAPE", "load_digits", "split_digits", "stripes"]

#: The generated stripes images: 1 channel of 12x12 pixels; horizontal, vertical and the two diagonals.
STRIPE_SHAPE = (1, 12, 12)
STRIPE_CLASSES = 4


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits: pixels ``float32 [N, 64]`` in ``[0, 1]`` and labels ``int64 [N]``."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            'The digits demo needs scikit-learn; install it with pip install "ort-lightning[cli]".'
        ) from error
    digits = sklearn_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return x, torch.tensor(digits.target, dtype=torch.int64)


def split_digits(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits cut into a training set and a held-out `val_fraction`, by a shuffle seeded with `seed`."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"Expected `val_fraction` in (0, 1), but got {val_fraction!r}.")
    x, y = load_digits()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held_out = int(len(y) * val_fraction)
    train, rest = order[held_out:], order[:held_out]
    return TensorDataset(x[train], y[train]), TensorDataset(x[rest], y[rest])


def stripes(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy 12x12 images of one short stripe each; the label is the stripe's direction."""
    generator = torch.Generator().manual_seed(seed)
    size = STRIPE_SHAPE[-1]
    labels = torch.randint(0, STRIPE_CLASSES, (count,), generator=generator)
    images = 0.3 * torch.randn((count, *STRIPE_SHAPE), generator=generator)
    steps = {0: (0, 1), 1: (1, 0), 2: (1, 1), 3: (1, -1)}
    starts = torch.randint(3, size - 3, (count, 2), generator=generator)
    for index in range(count):
        dy, dx = steps[int(labels[index])]
        y, x = (int(v) for v in starts[index])
        for offset in range(-2, 3):
            images[index, 0, y + offset * dy, x + offset * dx] += 1.0
    return images, labels
