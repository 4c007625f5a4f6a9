"""The speed goals, as ratios of medians measured in one run, with met / not met.

Ratios, not absolute times, so that one run on an idle machine decides them; a loaded machine
makes every ratio noisy (see BENCHMARKS.md), so a "not met" there proves nothing.

Example::

    >>> ms = {"lightning-ort": 1.8, "lightning-ort-hybrid": 1.7, "ort-loop": 0.8,
    ...       "lightning-torch": 2.4, "torch-loop": 1.3}
    >>> rows = goal_rows({"mlp-small": ms})
    >>> [row.split(" | ")[-1] for row in rows[2:]]
    ['met |', 'met |']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Slack of the overhead goal: the adapter may add this much over what Lightning adds to torch.
OVERHEAD_SLACK_MS = 0.1

Medians = dict[str, float]


@dataclass(frozen=True)
class Goal:
    """One goal: what it says, which models it applies to, the measured value and its target."""

    text: str
    cases: tuple[str, ...] | None  # None: every model
    measure: Callable[[Medians], float]
    target: Callable[[Medians], float]
    unit: str = "x"

    def row(self, case: str, ms: Medians) -> str:
        value, target = self.measure(ms), self.target(ms)
        met = "met" if value >= target else "**not met**"
        if self.unit == "ms":
            # NOTE: "less added is better": the comparison is flipped, shown as measured <= target.
            met = "met" if value <= target else "**not met**"
            return f"| {case} | {self.text} | {value:.3f} ms | <= {target:.3f} ms | {met} |"
        return f"| {case} | {self.text} | {value:.2f}x | >= {target:.2f}x | {met} |"


def _throughput(runner: str) -> Callable[[Medians], float]:
    return lambda ms: ms["lightning-torch"] / ms[runner]


GOALS = (
    Goal(
        "ms added by adapter+Lightning <= ms added by Lightning (torch) + 0.1",
        None,
        lambda ms: ms["lightning-ort"] - ms["ort-loop"],
        lambda ms: ms["lightning-torch"] - ms["torch-loop"] + OVERHEAD_SLACK_MS,
        unit="ms",
    ),
    Goal("throughput L+ORT / L+torch >= 1.25", ("mlp-small",), _throughput("lightning-ort"), lambda ms: 1.25),
    Goal(
        "throughput L+ORT-hybrid / L+torch >= 1 (torch AdamW over ORT's gradients)",
        ("mlp-compute",),
        _throughput("lightning-ort-hybrid"),
        lambda ms: 1.0,
    ),
    Goal(
        "throughput of the faster L+ORT runner / L+torch >= 1 (at least even)",
        ("bert-tiny",),
        lambda ms: ms["lightning-torch"] / min(ms["lightning-ort"], ms["lightning-ort-hybrid"]),
        lambda ms: 1.0,
    ),
)


def goal_rows(medians: dict[str, Medians]) -> list[str]:
    """The goals table for the models measured (median ms per step of each runner, by model)."""
    rows = ["| model | goal | measured | target | |", "|---|---|---|---|---|"]
    for case, ms in medians.items():
        rows += [goal.row(case, ms) for goal in GOALS if goal.cases is None or case in goal.cases]
    return rows
