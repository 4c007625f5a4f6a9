"""docs/fleets.md's bound on how far Flower's SecAgg+ aggregate may lie from the plain float64 FedAvg.

``|A - F| <= N (2c + D / 2) / (T * sum(r)) + 2**-23 * max|F|`` with ``r = round(n / W * T) / T``: Flower's
defaults, clipping range c = 8, quantization range T = 2**22, max weight W = 1000.
"""

from __future__ import annotations

import numpy as np

CLIPPING, TARGET, MAX_WEIGHT = 8.0, 2**22, 1000.0


def bound(updates: list[dict[str, np.ndarray]], counts: list[int], fedavg: dict[str, np.ndarray]) -> float:
    """The bound for `updates` of `counts` examples around `fedavg`, asserting first that the clipping does not bite."""
    ratios = [round(n / MAX_WEIGHT * TARGET) / TARGET for n in counts]
    assert max(r * np.max(np.abs(v)) for r, u in zip(ratios, updates, strict=True) for v in u.values()) < CLIPPING
    spread = max(np.max(np.abs(u[name] - fedavg[name])) for u in updates for name in fedavg)
    top = max(np.max(np.abs(v)) for v in fedavg.values())
    return len(updates) * (2 * CLIPPING + spread / 2) / (TARGET * sum(ratios)) + 2.0**-23 * top
