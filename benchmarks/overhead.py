"""``python -m benchmarks.overhead``: what each runner adds around its framework's compute, per step.

The overhead goal of ``python -m benchmarks`` subtracts medians of whole steps, so on a 2-core
machine a few milliseconds of variance in the kernels (ORT's two-thread runs stall for 4-6 ms in
bursts on some hosts) decide a 0.1 ms verdict. This probe times the compute inside every step and
subtracts it from that step's interval: ORT's train and optimizer calls in Lightning + ORT and in
the ORT loop; torch's loss (forward), ``backward`` and fused AdamW update in Lightning + torch and
in the torch loop. What remains is data loading, the loop, Lightning and the adapter. It also shows
ORT's compute under Lightning against the same compute in the ORT loop: a ratio above 1 is the
thread pools' contention (what the thread policy is for), not Python work.

Usage::

    python -m benchmarks.overhead                            # every model, 9 rounds x 20 steps
    python -m benchmarks.overhead --cases mlp-small --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.__main__ import PAUSE_S, _quiet
from benchmarks._goals import OVERHEAD_SLACK_MS
from benchmarks._models import CASES, Case
from benchmarks._runners import LightningORT, LightningTorch, ORTLoop, TorchLoop, _fit, export

#: The runners compared, in the order they take turns.
KEYS = ("lightning-ort", "ort-loop", "lightning-torch", "torch-loop")


class ComputeClock:
    """Sums the seconds spent in wrapped compute calls; the call that ends a step closes its sum."""

    def __init__(self) -> None:
        self.current = 0.0
        self.steps: list[float] = []

    def timed(self, function: Callable[..., Any], *, ends_step: bool = False) -> Callable[..., Any]:
        """`function`, timed into the current step (closing it after the call when `ends_step`)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.current += time.perf_counter() - start
            if ends_step:
                self.steps.append(self.current)
                self.current = 0.0
            return result

        return call

    def reset(self) -> None:
        self.current, self.steps = 0.0, []


class _TimedCase:
    """`case` with its torch loss (the forward) timed; everything else is the case's own."""

    def __init__(self, case: Case, clock: ComputeClock) -> None:
        self._case = case
        self.loss = clock.timed(case.loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._case, name)


class _TimedSession(pl.Callback):
    """Times the ORT session's train and optimizer calls during a fit of an ORTLightningModule."""

    def __init__(self, clock: ComputeClock) -> None:
        self.clock = clock
        self._saved: tuple[Any, Any, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # NOTE: after on_fit_start, where the thread policy may have rebuilt the session.
        session = pl_module.ort_session
        self._saved = (session, session._train, session.optimizer_step)
        session._train = self.clock.timed(session._train)
        session.optimizer_step = self.clock.timed(session.optimizer_step, ends_step=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        assert self._saved is not None
        session, train, update = self._saved
        session._train, session.optimizer_step = train, update
        # NOTE: ORT's bound calls hold its C++ Module, which writes into the state when it goes; kept here, they
        # outlived the session (closed first at the process's end, the Trainer and the module being a cycle).
        self._saved = None


@contextlib.contextmanager
def timed_torch(clock: ComputeClock) -> Iterator[None]:
    """Time torch's ``Tensor.backward`` and the fused AdamW update (which ends a step) inside the block.

    NOTE: patched on torch itself because Lightning calls both from inside its own loop; the
    fused update is looked up as ``torch._fused_adamw_`` at every step by torch's AdamW.
    """
    backward, update = torch.Tensor.backward, torch._fused_adamw_
    torch.Tensor.backward = clock.timed(backward)  # type: ignore[method-assign]
    torch._fused_adamw_ = clock.timed(update, ends_step=True)
    try:
        yield
    finally:
        torch.Tensor.backward, torch._fused_adamw_ = backward, update  # type: ignore[method-assign]


def _block(key: str, runner: Any, clock: ComputeClock, steps: int) -> tuple[float, float]:
    """One block of `steps` steps: the median interval and the median interval less its compute (s)."""
    clock.reset()
    if key == "lightning-ort":
        intervals = _fit(runner.module, runner.case.loader(steps + 1), _TimedSession(clock))
    elif key in ("lightning-torch", "torch-loop"):
        with timed_torch(clock):
            intervals = runner.run(steps)
    else:
        intervals = runner.run(steps)
    if len(clock.steps) != len(intervals) + 1:
        raise RuntimeError(
            f"{key}: timed the compute of {len(clock.steps)} steps in a block of {len(intervals) + 1} batches; "
            "a compute call is not wrapped (or one more is), so the subtraction would mix steps up."
        )
    # NOTE: the interval between batch ends i and i + 1 holds step i + 1's compute.
    compute = clock.steps[1:]
    around = [interval - spent for interval, spent in zip(intervals, compute, strict=True)]
    return statistics.median(intervals), statistics.median(around)


def measure(case: Case, rounds: int, steps: int, folder: Path) -> dict[str, list[tuple[float, float]]]:
    """Per runner, each round's (median step, median around the compute), in ms."""
    # NOTE: unverified: this probe times steps; `python -m benchmarks` verifies each case's export.
    artifacts = export(case, folder, verify=False)
    clock = ComputeClock()
    runners: dict[str, Any] = {
        "lightning-ort": LightningORT(case, artifacts), "ort-loop": ORTLoop(case, artifacts),
        "lightning-torch": LightningTorch(case, artifacts), "torch-loop": TorchLoop(case, artifacts),
    }
    loop = runners["ort-loop"]
    loop.train_step, loop.update = clock.timed(loop.train_step), clock.timed(loop.update, ends_step=True)
    for key in ("lightning-torch", "torch-loop"):
        target = runners[key].module if key == "lightning-torch" else runners[key]
        target.case = _TimedCase(case, clock)
    runners["lightning-ort"].run(LightningORT.warmup)  # the thread policy measures its candidates
    print(f"{case.name}: thread policy {runners['lightning-ort'].describe()}", file=sys.stderr, flush=True)
    for key in KEYS[1:]:
        runners[key].run(2)
    result: dict[str, list[tuple[float, float]]] = {key: [] for key in KEYS}
    for index in range(rounds):
        for key in KEYS[index % len(KEYS):] + KEYS[: index % len(KEYS)]:
            time.sleep(PAUSE_S)
            step, around = _block(key, runners[key], clock, steps)
            result[key].append((step * 1e3, around * 1e3))
    return result


def rows(name: str, result: dict[str, list[tuple[float, float]]]) -> str:
    """One Markdown row: the medians around the compute, the excess per round, and the verdict."""
    around = {key: statistics.median(a for _, a in values) for key, values in result.items()}
    compute = {key: statistics.median(s - a for s, a in values) for key, values in result.items()}
    excess = sorted(
        (result["lightning-ort"][i][1] - result["ort-loop"][i][1])
        - (result["lightning-torch"][i][1] - result["torch-loop"][i][1])
        for i in range(len(result["ort-loop"]))
    )
    middle = f"{excess[len(excess) // 4]:+.2f} to {excess[(3 * len(excess)) // 4]:+.2f}"
    median = statistics.median(excess)
    verdict = "met" if median <= OVERHEAD_SLACK_MS else "**not met**"
    cells = " | ".join(f"{around[key]:.2f}" for key in KEYS)
    contention = compute["lightning-ort"] / compute["ort-loop"]
    return f"| {name} | {cells} | {median:+.2f} ({middle}) | {verdict} | {contention:.2f}x |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    _quiet()
    print(
        "| model | ms around the compute: Lightning + ORT | ORT loop | Lightning + torch | torch loop "
        f"| adapter's ms beyond Lightning's (median of rounds, middle half) | <= {OVERHEAD_SLACK_MS} ms "
        "| ORT's compute: under Lightning / in the ORT loop |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="ort-lightning-overhead-") as folder:
        for name in args.cases:
            print(rows(name, measure(CASES[name], args.rounds, args.steps, Path(folder))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
