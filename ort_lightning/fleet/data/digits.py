"""Partitions of scikit-learn's bundled digits across simulated devices (nothing downloads).

`DigitsPartitions` is the ``data`` of a `DeviceClient`: device ``i`` of ``n`` gets its share
of the training split, cut into ``n`` contiguous parts of one ordering of it:

- ``"iid"``: a seeded shuffle.
- ``"label"``: sorted by label, so that each device sees one or two digits (the usual
  non-IID "shards").
- ``"writers"``: sorted by writer-like group (`writer_groups`), shuffled within a group, so
  that each device holds the digits of one writer-like group (two at a boundary): devices
  differ in how many digits they hold, in which labels and in the style of the strokes, as
  the devices of a handwriting population (FEMNIST's writers) do. With 1,000 devices each
  holds one or two of the 1,438 training images.

Each device evaluates on its IID share of the held-out split. The held-out split is the one
`ort_lightning.demo.DigitsDataModule` holds out (`ort_lightning.demo_data.split_digits`).

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

from ort_lightning.demo_data import split_digits
from ort_lightning.fleet.devices.protocol import ClientData

__all__ = ["SPLITS", "WRITERS", "DigitsPartitions", "digits_test_loader", "writer_groups"]

SPLITS = ("iid", "label", "writers")
#: Writer-like groups: scikit-learn's digits are the UCI test set, written by 13 people (its DESCR).
WRITERS = 13


@lru_cache(maxsize=8)
def _splits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    # NOTE: loading and splitting the digits costs about 0.7 s, and a fleet asks for every device's
    # partition every round; callers index these tensors (a copy) and never write into them.
    return split_digits(seed=seed)


@lru_cache(maxsize=8)
def writer_groups(seed: int = 0, groups: int = WRITERS) -> torch.Tensor:
    """A writer-like group per training image (int64 ``[N]`` in ``[0, groups)``), deterministic under `seed`.

    scikit-learn does not label the writers, so groups are derived from style: each image minus
    the mean image of its digit (what is left is how it was written: stroke thickness, slant,
    position), clustered by k-means into `groups` groups (scikit-learn's ``KMeans``, seeded).
    Style clustering is chosen over a Dirichlet label skew because it keeps what a writer
    population has and a label skew lacks: devices differ in their strokes, not only in their
    labels; and the label skew it brings is the data's own (a thick-stroked writer's residuals
    look alike across digits, so groups hold uneven digit mixes: total variation from the
    global label distribution of 0.16-0.85 per group at seed 0), not a drawn parameter.

    Example::

        >>> groups = writer_groups(0)
        >>> groups.shape, int(groups.max()) + 1
        (torch.Size([1438]), 13)
    """
    from sklearn.cluster import KMeans

    x, y = _splits(seed)[0].tensors
    means = torch.stack([x[y == label].mean(0) for label in range(int(y.max()) + 1)])
    style = (x - means[y]).numpy()
    labels = KMeans(groups, n_init=4, random_state=seed).fit_predict(style)
    return torch.as_tensor(labels, dtype=torch.int64)


def digits_test_loader(seed: int = 0, batch_size: int = 256) -> DataLoader:
    """The held-out digits (20 %), for the server's evaluation of the global values."""
    return DataLoader(_splits(seed)[1], batch_size=batch_size)


@dataclass(frozen=True)
class DigitsPartitions:
    """``(partition, partitions) -> ClientData`` over the digits; picklable, for Flower's Ray simulation.

    Args:
        split: ``"iid"``, ``"label"`` or ``"writers"`` (see the module docstring).
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
                f"Expected `split` to be one of {SPLITS}, but got {self.split!r}; pass \"iid\", \"label\" or "
                "\"writers\"."
            )

    def __call__(self, partition: int, partitions: int) -> ClientData:
        """Device `partition`'s training share and its share of the held-out digits."""
        if not 0 <= partition < partitions:
            raise ValueError(f"Expected 0 <= partition < {partitions}, but got {partition}.")
        train, held_out = _splits(self.seed)
        x, y = train.tensors
        mine = _order(self.split, self.seed)[_part(len(y), partition, partitions)]
        vx, vy = held_out.tensors
        theirs = _part(len(vy), partition, partitions)
        generator = torch.Generator().manual_seed(self.seed + partition)
        return ClientData(
            train=DataLoader(TensorDataset(x[mine], y[mine]), batch_size=self.batch_size, shuffle=self.shuffle,
                             generator=generator),
            test=DataLoader(TensorDataset(vx[theirs], vy[theirs]), batch_size=256),
        )


def _part(count: int, partition: int, partitions: int) -> slice:
    """Rows of part `partition` when `count` rows are cut into `partitions` parts as ``torch.tensor_split`` cuts."""
    # NOTE: arithmetic, not tensor_split: a 1,000-device fleet asks for one part 1,000 times a round.
    size, larger = divmod(count, partitions)
    start = partition * size + min(partition, larger)
    return slice(start, start + size + (partition < larger))


@lru_cache(maxsize=16)
def _order(split: str, seed: int) -> torch.Tensor:
    """The training split's rows in the order `split` cuts them into devices."""
    labels = _splits(seed)[0].tensors[1]
    if split == "label":
        return torch.argsort(labels, stable=True)
    shuffle = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    if split == "writers":
        return shuffle[torch.argsort(writer_groups(seed)[shuffle], stable=True)]
    return shuffle
