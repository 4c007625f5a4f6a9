"""The thread policy's trial: which candidate each batch times, when a fit is worth measuring, which wins.

Example::

    >>> [timed for timed, _ in Trial.of(2, warmup=1, block=2, rounds=1).plan]
    [None, 0, 0, 1, 1]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["StepWatch", "Trial", "fastest", "session_tunable", "should_skip_tuning"]


@dataclass
class Trial:
    """The tuning plan: per batch interval, the candidate it times (None: warm-up) and whether it counts."""

    plan: list[tuple[int | None, bool]]
    times: dict[int, list[float]]
    ends: int = 0
    last: float = 0.0

    @classmethod
    def of(cls, candidates: int, *, warmup: int, block: int, rounds: int) -> Trial:
        """`warmup` untimed batches, then `rounds` rounds of `block` batches per candidate, interleaved."""
        plan: list[tuple[int | None, bool]] = [(None, False)] * warmup
        for _ in range(rounds):
            for index in range(candidates):
                # NOTE: the first interval after a switch pays for waking or parking threads; it is not counted.
                plan += [(index, False)] + [(index, True)] * (block - 1)
        return cls(plan, {index: [] for index in range(candidates)})


def fastest(medians: list[float], *, margin: float) -> int:
    """The index of the fastest candidate, or 0 (the default) unless one beats it by `margin`.

    NOTE: a few timed steps carry a few percent of noise, and a session rebuild is not free.

    Example::

        >>> fastest([10.0, 9.8, 12.0], margin=0.05), fastest([10.0, 9.0, 12.0], margin=0.05)
        (0, 1)
    """
    best = min(range(len(medians)), key=medians.__getitem__)
    return best if medians[best] < medians[0] * (1.0 - margin) else 0


def session_tunable(trainer: Any, rebuildable: bool) -> bool:
    """Whether ORT's session may be rebuilt between two steps: one process, no accumulation, a route given.

    NOTE: a rebuild keeps the weights and optimizer state, not gradients summed over an accumulation window.
    """
    return rebuildable and trainer.world_size == 1 and trainer.accumulate_grad_batches == 1


def should_skip_tuning(trainer: Any, min_fit_steps: int) -> tuple[bool, str]:
    """Whether the fit is too short to spend steps measuring (``fast_dev_run``, few steps), and why."""
    if trainer.fast_dev_run:
        return True, "fast_dev_run: the first candidate is kept unmeasured"
    try:
        steps = float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 - a loader without a length: the fit's length is unknown, so measure
        return False, ""
    if steps < min_fit_steps:
        return True, f"a fit of {steps:.0f} optimizer steps (< {min_fit_steps}): the first candidate is kept unmeasured"
    return False, ""


class StepWatch:
    """The step time of the setting in use, read every `window` steps: has the median of `windows` passed `limit`?"""

    def __init__(self, limit: float, *, window: int = 16, windows: int = 5) -> None:
        self.limit, self.window = limit, window
        self.means = [0.0] * windows
        self.filled = 0
        self.count = 0
        self.start = time.perf_counter()

    def stalled(self) -> bool:
        """Count one step; at a window's end, whether the recent windows' median exceeds the limit."""
        self.count += 1
        if self.count < self.window:
            return False
        now = time.perf_counter()
        self.means[self.filled % len(self.means)] = (now - self.start) / self.count
        self.filled += 1
        self.count, self.start = 0, now
        return self.filled >= len(self.means) and statistics.median(self.means) > self.limit

    def restart(self) -> None:
        """Drop the window under way (time spent outside training steps, a validation run)."""
        self.count, self.start = 0, time.perf_counter()

    def describe(self) -> str:
        """The recent median against the limit, for the log."""
        return f"recent steps {statistics.median(self.means) * 1e3:.2f} ms, over the limit {self.limit * 1e3:.2f} ms"
