"""``data.partition: ordered``: each device a contiguous block of the training set, in the data's own order."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ort_lightning.fleet.data.partitions import Partitions, partition_rows


def test_ordered_rows_are_contiguous_blocks_as_numpy_cuts_them() -> None:
    labels = torch.tensor([2, 0, 1, 2, 0, 1, 1, 0, 2, 2])
    parts = partition_rows(labels, 3, scheme="ordered")
    assert [part.tolist() for part in parts] == [part.tolist() for part in np.array_split(np.arange(10), 3)]


def test_each_device_trains_its_own_block() -> None:
    topics = torch.arange(12) // 4  # three topics of four rows, one after another
    rows = torch.arange(12)
    partitions = Partitions(TensorDataset(rows, topics), scheme="ordered", batch_size=3, seed=5)
    for device in range(3):
        batches = list(partitions(device, 3).train)
        seen = torch.cat([batch[0] for batch in batches])
        assert sorted(seen.tolist()) == list(range(4 * device, 4 * device + 4))
        assert set(torch.cat([batch[1] for batch in batches]).tolist()) == {device}
