"""docs/fleets.md's bound on how far Flower's SecAgg+ aggregate lands from the plain FedAvg of the same updates.

``|A - F| <= N (2c + D / 2) / (T * sum(r)) + 2**-23 * max|F|`` with ``r = round(n / W * T) / T``: N devices of
n examples each, c the clipping range, T the quantization range, W the largest weight, D the updates' spread
around F. Shared by the secure fleet's tests of every engine.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CLIPPING", "MAX_WEIGHT", "TARGET", "fedavg", "secagg_bound"]

#: Flower's SecAgg+ defaults: the clipping range, the quantization range and the largest weight.
CLIPPING, TARGET, MAX_WEIGHT = 8.0, 2**22, 1000.0


def fedavg(updates: list[dict[str, np.ndarray]], counts: list[int]) -> dict[str, np.ndarray]:
    """The example-weighted mean of `updates`, in float64."""
    return {name: sum(u[name].astype(np.float64) * n for u, n in zip(updates, counts, strict=True)) / sum(counts)
            for name in updates[0]}


def secagg_bound(updates: list[dict[str, np.ndarray]], counts: list[int], average: dict[str, np.ndarray]) -> float:
    """The bound on |SecAgg+ aggregate - `average`| per value, asserting first that the clipping does not bite."""
    ratios = [round(n / MAX_WEIGHT * TARGET) / TARGET for n in counts]
    assert max(r * np.max(np.abs(v)) for r, u in zip(ratios, updates, strict=True) for v in u.values()) < CLIPPING
    spread = max(np.max(np.abs(u[name] - average[name])) for u in updates for name in average)
    top = max(np.max(np.abs(v)) for v in average.values())
    return len(updates) * (2 * CLIPPING + spread / 2) / (TARGET * sum(ratios)) + 2.0**-23 * top
