"""``python -m benchmarks.calls``: Python function calls per training step of each runner, by cProfile.

Call counts do not depend on the machine's load, unlike timings: they show what the adapter adds
to Lightning's loop on a machine too busy to time 0.1 ms. In parentheses: the calls to
ort-lightning's own functions.

Usage::

    python -m benchmarks.calls --cases mlp-small cnn-small
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import ORDER, _quiet
from benchmarks._models import CASES
from benchmarks._runners import RUNNERS, export


def calls_per_step(name: str, steps: int, folder: Path) -> dict[str, tuple[float, float]]:
    """``runner -> (all calls, ort_lightning calls)`` per step for the model `name`."""
    case = CASES[name]
    artifacts = export(case, folder)
    counts = {}
    for key in ORDER:
        runner = RUNNERS[key](case, artifacts)
        runner.run(3)
        profile = cProfile.Profile()
        profile.enable()
        runner.run(steps)
        profile.disable()
        stats = pstats.Stats(profile)
        own = sum(row[1] for where, row in stats.stats.items() if "ort_lightning" in where[0])  # type: ignore[attr-defined]
        counts[key] = (stats.total_calls / steps, own / steps)  # type: ignore[attr-defined]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    _quiet()
    rows = ["| model | " + " | ".join(RUNNERS[key].label for key in ORDER) + " |", "|---" * (len(ORDER) + 1) + "|"]
    with tempfile.TemporaryDirectory(prefix="ort-lightning-calls-") as folder:
        for name in args.cases:
            counts = calls_per_step(name, args.steps, Path(folder))
            cells = " | ".join(f"{counts[key][0]:,.0f} ({counts[key][1]:.0f})" for key in ORDER)
            rows.append(f"| {name} | {cells} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
