"""Any training set cut into devices, seeded: IID, by label (shards), Dirichlet(alpha) over the labels, or in order.

``ordered`` keeps the data module's own order: each device a contiguous block of its training set
(a data module that lists its text topic after topic gives each device a topic).

Example::

    >>> labels = torch.arange(12) % 3
    >>> [part.tolist() for part in partition_rows(labels, 3, scheme="label")]
    [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.protocol import ClientData

__all__ = ["SCHEMES", "Partitions", "partition_rows", "tensor_dataset"]

SCHEMES = ("iid", "label", "dirichlet", "ordered")
#: Draws of Dirichlet proportions before giving up on a partition that leaves a device empty.
_DRAWS = 100


def tensor_dataset(dataset: Dataset) -> TensorDataset:
    """`dataset`'s ``(inputs..., label)`` examples stacked: no class of the user's travels to a device."""
    examples = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
    if not examples or not isinstance(examples[0], tuple | list):
        raise ConfigurationError("Expected the data module's training set to yield (inputs..., label) tuples, but "
                                 f"got {type(examples[0]).__name__ if examples else 'no examples'}; return tuples.")
    return TensorDataset(*(torch.stack([torch.as_tensor(example[i]) for example in examples])
                           for i in range(len(examples[0]))))


def partition_rows(labels: torch.Tensor, partitions: int, *, scheme: str = "iid", alpha: float = 0.5,
                   seed: int = 0) -> list[torch.Tensor]:
    """Each device's rows: ``iid`` shuffled, ``label`` by sorted label, ``dirichlet`` per label, ``ordered`` as is."""
    if partitions > len(labels):
        raise ConfigurationError(f"Expected at most {len(labels)} devices for {len(labels)} training examples, but "
                                 f"got {partitions}; lower devices.count.")
    generator = torch.Generator().manual_seed(seed)
    if scheme == "dirichlet":
        return _dirichlet(labels, partitions, alpha, seed)
    if scheme == "ordered":
        order = torch.arange(len(labels))
    elif scheme == "label":
        order = torch.argsort(labels, stable=True)
    else:
        order = torch.randperm(len(labels), generator=generator)
    return list(torch.tensor_split(order, partitions))


def _dirichlet(labels: torch.Tensor, partitions: int, alpha: float, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    by_label = [rng.permutation(np.flatnonzero(labels.numpy() == value)) for value in np.unique(labels.numpy())]
    for _ in range(_DRAWS):
        parts: list[list[int]] = [[] for _ in range(partitions)]
        for rows in by_label:
            cuts = (np.cumsum(rng.dirichlet([alpha] * partitions))[:-1] * len(rows)).astype(int)
            for device, share in enumerate(np.split(rows, cuts)):
                parts[device].extend(share.tolist())
        if min(map(len, parts)) > 0:
            return [torch.as_tensor(sorted(part), dtype=torch.int64) for part in parts]
    raise ConfigurationError(f"Dirichlet({alpha}) left a device without examples in {_DRAWS} draws for {partitions} "
                             f"devices over {len(labels)} examples; raise data.alpha or lower devices.count.")


@dataclass(frozen=True)
class Partitions:
    """A device's ``data``: its rows of `train` (labels last), shuffled by a generator seeded ``seed + partition``."""

    train: TensorDataset
    scheme: str = "iid"
    alpha: float = 0.5
    batch_size: int = 16
    seed: int = 0

    def __call__(self, partition: int, partitions: int) -> ClientData:
        """Device `partition`'s training batches (it does not evaluate: the server does)."""
        labels = self.train.tensors[-1]
        rows = partition_rows(labels, partitions, scheme=self.scheme, alpha=self.alpha, seed=self.seed)[partition]
        mine = TensorDataset(*(tensor[rows] for tensor in self.train.tensors))
        generator = torch.Generator().manual_seed(self.seed + partition)
        return ClientData(train=DataLoader(mine, batch_size=self.batch_size, shuffle=True, generator=generator))
