"""docs/fleets.md's bound on how far a SecAgg+ aggregate may be from the plain FedAvg of the same updates.

``|A - F| <= N (2c + D / 2) / (T * sum(r)) + 2**-23 * max|F|`` with ``r = round(n / W * T) / T``: the
quantization step of each of the N devices' weighted values, their spread D around F, and float32's rounding.
"""

from __future__ import annotations

import numpy as np

#: Flower's defaults: the clipping range c, the quantization range T and the max weight W.
CLIPPING, TARGET, MAX_WEIGHT = 8.0, 2**22, 1000.0


def bound(updates: list[dict[str, np.ndarray]], counts: list[int], fedavg: dict[str, np.ndarray]) -> float:
    """The bound on ``|A - F|`` for `updates` of `counts` examples, asserting first that the clipping does not bite."""
    ratios = [round(n / MAX_WEIGHT * TARGET) / TARGET for n in counts]
    assert max(r * np.max(np.abs(v)) for r, u in zip(ratios, updates, strict=True) for v in u.values()) < CLIPPING
    spread = max(np.max(np.abs(u[name] - fedavg[name])) for u in updates for name in fedavg)
    top = max(np.max(np.abs(v)) for v in fedavg.values())
    return len(updates) * (2 * CLIPPING + spread / 2) / (TARGET * sum(ratios)) + 2.0**-23 * top
