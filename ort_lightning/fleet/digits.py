"""Partitions of scikit-learn's bundled digits across simulated devices (nothing downloads).

`DigitsPartitions` is the ``data`` of a `FleetClient`: device ``i`` of ``n`` gets its share
of the training split, either IID (a seeded shuffle cut into ``n`` parts) or by label (the
training split sorted by label and cut into ``n`` parts, so that each device sees one or two
digits: the usual non-IID "shards"). Each device evaluates on its IID share of the held-out
split. The held-out split is the one `ort_lightning.demo.DigitsDataModule` holds out.

Example::

    >>> parts = DigitsPartitions(split="label")
    >>> data = parts(0, 10)
    >>> sorted(set(int(y) for _, y in data.train.dataset))
    [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning.demo import DigitsDataModule
from ort_lightning.fleet.client import ClientData

__all__ = ["SPLITS", "DigitsPartitions", "digits_test_loader"]

SPLITS = ("iid", "label")


@lru_cache(maxsize=8)
def _splits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    # NOTE: loading and splitting the digits costs about 0.7 s, and a fleet asks for every device's
    # partition every round; callers index these tensors (a copy) and never write into them.
    data = DigitsDataModule(seed=seed)
    data.setup("fit")
    return data.train_set, data.val_set


def digits_test_loader(seed: int = 0, batch_size: int = 256) -> DataLoader:
    """The held-out digits (20 %), for the server's evaluation of the global values."""
    return DataLoader(_splits(seed)[1], batch_size=batch_size)


@dataclass(frozen=True)
class DigitsPartitions:
    """``(partition, partitions) -> ClientData`` over the digits; picklable, for Flower's Ray simulation.

    Args:
        split: ``"iid"`` or ``"label"`` (see the module docstring).
        batch_size: training batch size on every device.
        seed: seed of the train/held-out split, the IID shuffle and the devices' batch shuffles.
        shuffle: shuffle each device's batches every epoch.
    """

    split: str = "iid"
    batch_size: int = 32
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(
                f"Expected `split` to be one of {SPLITS}, but got {self.split!r}; pass \"iid\" or \"label\"."
            )

    def __call__(self, partition: int, partitions: int) -> ClientData:
        """Device `partition`'s training share and its share of the held-out digits."""
        if not 0 <= partition < partitions:
            raise ValueError(f"Expected 0 <= partition < {partitions}, but got {partition}.")
        train, held_out = _splits(self.seed)
        x, y = train.tensors
        order = self._order(y)
        mine = torch.tensor_split(order, partitions)[partition]
        vx, vy = held_out.tensors
        theirs = torch.tensor_split(torch.arange(len(vy)), partitions)[partition]
        generator = torch.Generator().manual_seed(self.seed + partition)
        return ClientData(
            train=DataLoader(TensorDataset(x[mine], y[mine]), batch_size=self.batch_size, shuffle=self.shuffle,
                             generator=generator),
            test=DataLoader(TensorDataset(vx[theirs], vy[theirs]), batch_size=256),
        )

    def _order(self, labels: torch.Tensor) -> torch.Tensor:
        if self.split == "label":
            return torch.argsort(labels, stable=True)
        return torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
