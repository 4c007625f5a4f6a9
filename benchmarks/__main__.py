"""``python -m benchmarks``: Lightning + ORT against its alternatives, interleaved in one run.

For each model the six runners (Lightning + ORT, the same with ``threads="off"``, Lightning + ORT
with a torch optimizer, a hand-written ORT loop, Lightning + torch, a hand-written torch loop) take
turns, a block of steps each, round after round, so that machine noise falls on all of them alike; medians, ratios and
the goals (met / not met) come from the same run. Then the bridge (DLPack vs numpy per batch
size), the machine's matmul peak and each runner's peak memory. ``python -m benchmarks.profile``
shows which kernels take the time, in ORT and in torch.

Usage::

    python -m benchmarks                      # the full run recorded in BENCHMARKS.md
    python -m benchmarks --quick              # a smoke run of seconds (what the tests run); no usable numbers
    python -m benchmarks --cases bert-tiny    # some models only
    python -m benchmarks --markdown out.md    # also write the tables as Markdown
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from benchmarks import _probes, _runners
from benchmarks._goals import goal_rows
from benchmarks._models import CASES, Case, images
from benchmarks._runners import RUNNERS, export

#: Seconds between two runners' blocks.
PAUSE_S = 0.2

ORDER = ["lightning-ort", "lightning-ort-off", "lightning-ort-hybrid", "ort-loop", "lightning-torch", "torch-loop"]

_SMOKE = (
    "**SMOKE RUN (--quick): a few steps of one model, to check that the harness works. These timings are "
    "noise, not measurements; run `python -m benchmarks` (about 3 minutes) for numbers.**"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: seconds; timings are noise")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=None, help="models to run")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per model")
    parser.add_argument("--steps", type=int, default=None, help="steps per runner per round")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables to this Markdown file")
    parser.add_argument(
        "--threads", choices=("auto", "off"), default="auto",
        help="the adapter's thread policy in the Lightning + ORT runners (off: both thread pools as they are; "
        "the threads=off runner stays off)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS probes (minutes on big models)")
    parser.add_argument("--memory-child", nargs=3, metavar=("CASE", "RUNNER", "STEPS"), help=argparse.SUPPRESS)
    return parser


def measure_case(case: Case, rounds: int, steps: int, folder: Path, *, verify: bool = True) -> dict[str, list[float]]:
    """Per-step intervals of each runner, interleaved over `rounds` rounds of `steps` steps (export verified unless
    told not)."""
    artifacts = export(case, folder, verify=verify)
    runners = {key: RUNNERS[key](case, artifacts) for key in ORDER}
    for runner in runners.values():
        # NOTE: first-call allocations, thread pools, Lightning's first fit, the thread policy's measurements.
        runner.run(getattr(runner, "warmup", 2))
        if hasattr(runner, "describe"):
            print(f"{case.name}, {runner.label}: thread policy {runner.describe()}", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {key: [] for key in ORDER}
    for round_index in range(rounds):
        # NOTE: the order rotates every round so that no runner always follows the same one.
        shift = round_index % len(ORDER)
        for key in ORDER[shift:] + ORDER[:shift]:
            # NOTE: ORT's and torch's thread pools spin for a while after their last kernel; a
            # pause between blocks keeps one runner's spinning threads off the next one's cores.
            time.sleep(PAUSE_S)
            times[key].extend(runners[key].run(steps))
    return times


def _case_rows(case: Case, times: dict[str, list[float]], peak: float, memory: dict[str, float] | None) -> list[str]:
    flops = case.train_flops()
    rows = []
    for key in ORDER:
        seconds = statistics.median(times[key])
        gflops = flops / seconds / 1e9
        rss = f"{memory[key]:.0f}" if memory else "-"
        # NOTE: torch's FLOP counter has no formula for some ops (LSTM): no figure rather than 0.
        compute = f"{gflops:.1f} | {gflops / peak:.0%}" if flops else "n/a | n/a"
        rows.append(
            f"| {case.name} | {RUNNERS[key].label} | {seconds * 1e3:.3f} | {case.batch_size / seconds:,.0f} | "
            f"{compute} | {rss} |"
        )
    return rows


def _ratio_row(case: Case, times: dict[str, list[float]]) -> str:
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    return (
        f"| {case.name} | {ms['lightning-ort'] / ms['ort-loop']:.3f}x | "
        f"{ms['lightning-torch'] / ms['torch-loop']:.3f}x | "
        f"{ms['lightning-torch'] / ms['lightning-ort']:.2f}x | "
        f"{ms['lightning-torch'] / ms['lightning-ort-hybrid']:.2f}x | {ms['lightning-ort'] - ms['ort-loop']:.3f} | "
        f"{ms['lightning-torch'] - ms['torch-loop']:.3f} |"
    )


def run(args: argparse.Namespace) -> str:
    """Measure everything the options ask for; return the report as Markdown."""
    quick = args.quick
    _runners.THREADS = args.threads
    names = args.cases or (["mlp-small"] if quick else list(CASES))
    rounds = args.rounds or (2 if quick else 7)
    steps = args.steps or (5 if quick else 60)
    peak = _probes.matmul_peak_gflops(256 if quick else 1024, 3 if quick else 20)
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}; "
        f"{datetime.date.today().isoformat()}; matmul peak {peak:.1f} GFLOP/s.",
        f"Command: python -m benchmarks{' --quick' if quick else ''} --threads {args.threads}; "
        f"{rounds} interleaved rounds x {steps} steps "
        "per runner; medians of per-step times (data loading included).",
        "",
        "| model | runner | ms/step | samples/s | GFLOP/s | of peak | peak RSS added MB |",
        "|---|---|---|---|---|---|---|",
    ]
    if quick:
        lines[:0] = [_SMOKE, ""]
    ratios = [
        "| model | L+ORT / ORT loop | L+torch / torch loop | throughput L+ORT / L+torch | "
        "throughput L+ORT-hybrid / L+torch | ms added by adapter+Lightning | ms added by Lightning |",
        "|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    by_round: dict[str, list[dict[str, float]]] = {}  # each round's medians, for the goals' noise
    with tempfile.TemporaryDirectory(prefix="ort-lightning-bench-") as folder:
        for name in names:
            case = CASES[name]
            # NOTE: a smoke run checks the harness, not the export (the test suite verifies exports): its two
            # verifications, a child process each, were a fifth of its time.
            times = measure_case(case, rounds, steps, Path(folder), verify=not quick)
            memory = None if quick or args.no_memory else {key: _probes.peak_rss_mb(name, key, 200) for key in ORDER}
            lines += _case_rows(case, times, peak, memory)
            ratios.append(_ratio_row(case, times))
            medians[name] = {key: statistics.median(values) * 1e3 for key, values in times.items()}
            by_round[name] = [
                {key: statistics.median(values[start : start + steps]) * 1e3 for key, values in times.items()}
                for start in range(0, rounds * steps, steps)
            ]
            print(f"measured {name}", file=sys.stderr, flush=True)
        linear = export(Case("linear", lambda: torch.nn.Linear(784, 10), images((784,)), 64), Path(folder),
                        verify=not quick)
        sizes = [64, 4096] if quick else [16, 64, 256, 1024, 4096]
        measured = _probes.bridge_microseconds(linear, sizes, repeats=20 if quick else 300)
    bridge = [
        "| batch (linear 784->10) | DLPack binder µs | train step via DLPack µs | train step via numpy µs "
        "| numpy / DLPack |",
        "|---|---|---|---|---|",
    ]
    bridge += [f"| {b} | {w:.1f} | {d:.1f} | {n:.1f} | {n / d:.2f}x |" for b, w, d, n in measured]
    goals = goal_rows(medians, by_round)
    return "\n".join([*lines, "", *ratios, "", *goals, "", *bridge]) + "\n"


class _PrebuiltData:
    """`case` with its loader built once, so that a memory probe does not count the data."""

    def __init__(self, case: Case, loader: Any) -> None:
        self._case, self._loader = case, loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._case, name)

    def loader(self, steps: int) -> Any:
        return self._loader


def memory_child(case_name: str, runner_key: str, steps: int) -> None:
    """Build one runner in this fresh process, train `steps` steps, print its peak RSS in MB.

    Printed is the peak over the run minus the resident memory just before the runner is built:
    what the runner itself takes (weights, optimizer state, sessions, activations), without the
    imports, the export and the generated data (built before, the same for every runner: 154 MB
    of mlp-compute's 200 batches) that every runner shares.
    """
    case = CASES[case_name]
    with tempfile.TemporaryDirectory(prefix="ort-lightning-mem-") as folder:
        artifacts = export(case, Path(folder))
        data = _PrebuiltData(case, case.loader(steps + 1))
        gc.collect()
        _probes.reset_peak_rss()
        before = _probes.own_peak_rss_mb()
        runner = RUNNERS[runner_key](case, artifacts)
        runner.case = data
        runner.run(steps)
        print(f"{_probes.own_peak_rss_mb() - before:.1f}")


def _quiet() -> None:
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _quiet()
    if args.memory_child:
        case, runner, steps = args.memory_child
        memory_child(case, runner, int(steps))
        return 0
    report = run(args)
    print(report)
    if args.markdown:
        args.markdown.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
