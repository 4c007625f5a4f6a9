"""`ThreadPolicy`: ONNX Runtime's and torch's thread pools sharing the cores of an ORT fit.

Both pools spin after their last kernel, so on few cores each takes the cores the other needs.
During a fit the policy sizes ORT's pool to the cores this process may use (per rank under
``"ort_ddp"``), lowers torch to one thread while ORT computes, measures the candidate settings on
the first steps of a long fit and keeps the fastest, watches for a stall, and restores torch's
threads when the fit ends. A thread count the user chose is never overridden, and numerics do not
change. Measured in BENCHMARKS.md, section "The thread policy".

Example::

    >>> policy = ThreadPolicy("auto")
    >>> [setting.name for setting in policy.candidates(4, session=True)]
    ['torch 1 thread', 'torch 4 threads', 'ORT on 1 thread, torch 1 thread']
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ort_lightning.strategies import ORTDDPStrategy, thread_spinning
from ort_lightning.training.threads.cores import THREAD_MODES, available_cores, check_threads, user_torch_threads
from ort_lightning.training.threads.trial import StepWatch, Trial, fastest, session_tunable, should_skip_tuning

__all__ = [
    "THREAD_MODES",
    "ThreadPolicy",
    "ThreadSetting",
    "available_cores",
    "check_threads",
    "user_torch_threads",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ThreadSetting:
    """One way to share the cores during a fit (torch's threads, ORT's pool size), applied between two steps."""

    name: str
    torch_threads: int
    ort_threads: int | None = None


#: Lightning's per-batch callback hooks that the policy never needs: Lightning dispatches every
#: hook of every callback, and skips an attribute that is not callable (``call._call_callback_hooks``).
_IDLE_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_validation_batch_start", "on_validation_batch_end",
)


def _local_ranks(strategy: Any) -> int:
    """How many ranks of `strategy` share this machine's CPU."""
    if isinstance(strategy, ORTDDPStrategy) and strategy.root_device.type == "cpu":
        return max(1, strategy.num_processes)
    return 1


class ThreadPolicy(pl.Callback):
    """The thread policy of one `ORTLightningModule`, active during its fits.

    Args:
        mode: ``"auto"`` (share the cores, tuned on the first steps), ``"off"`` (change nothing) or
            ``"single"`` (ORT on one thread that does not spin: many small fits, as a fleet worker runs).
        warmup: batches before the first candidate is timed.
        block: batches per candidate and round (the first of each is not timed).
        rounds: times each candidate is visited, interleaved.
        min_fit_steps: optimizer steps a fit needs for the candidates to be measured at all.
        margin: how much faster another candidate must be than the first to replace it.
        revisit_factor: how much slower than in the trial recent steps must be for a new measurement
            (once per fit; 0: never).
        watch: steps per clock read of the step-time watch, and windows in its median.

    Attributes:
        choice: the setting in use in the last fit (None before a fit or with the policy idle).
        reason: why (measured, or why nothing was measured or changed).
    """

    def __init__(
        self, mode: str = "auto", *, warmup: int = 3, block: int = 4, rounds: int = 3, min_fit_steps: int = 100,
        margin: float = 0.05, revisit_factor: float = 1.5, watch: tuple[int, int] = (16, 5),
    ) -> None:
        check_threads(mode)
        self.mode = mode
        self.warmup, self.block, self.rounds, self.min_fit_steps = warmup, block, rounds, min_fit_steps
        self.margin, self.revisit_factor, self.watch = margin, revisit_factor, watch
        self.choice: ThreadSetting | None = None
        self.reason = "no fit yet"
        self._saved: int | None = None
        self._candidates: list[ThreadSetting] = []
        self._trial: Trial | None = None
        self._route: Callable[[bool, int], None] | None = None  # how the module's ORT session changes its threads
        self._rethread: Callable[[bool, int], None] | None = None  # the route, during a fit the policy acts in
        self._default = (True, 0)  # ORT's spinning and pool size before any candidate
        self._kept: ThreadSetting | None = None  # the setting measured fastest; later fits keep it
        self._kept_seconds = 0.0  # its step time in the trial
        self._watch: StepWatch | None = None  # the step-time watch after the decision
        self._revisits = 0  # trials left in this fit for a stalled choice

    def __getstate__(self) -> dict[str, Any]:
        """Leave out the routes to the module's session (it holds ONNX Runtime's objects, which do not pickle)."""
        state = {**self.__dict__, "_trial": None, "_route": None, "_rethread": None, "_watch": None}
        for name in _IDLE_HOOKS:
            state.pop(name, None)
        return state

    # ----------------------------------------------------------------------------- ORT's session
    def spinning(self, strategy: Any) -> bool:
        """Whether ORT's intra-op threads should spin: yes, except where ranks share the CPU."""
        if self.mode == "single":
            return False
        return True if strategy is None else thread_spinning(strategy)

    def session_threads(self, strategy: Any) -> int:
        """ORT's intra-op pool size: the cores over the ranks sharing them (or an earlier fit's pick); 0 when off."""
        if self.mode != "auto":
            return 0 if self.mode == "off" else 1
        kept = self._kept
        if kept is not None and kept.ort_threads is not None and _local_ranks(strategy) == 1 and self._should_act()[0]:
            return kept.ort_threads
        return self._cores(strategy)

    def _cores(self, strategy: Any) -> int:
        return max(1, available_cores() // _local_ranks(strategy))

    def candidates(self, cores: int, *, session: bool = False) -> list[ThreadSetting]:
        """The settings worth measuring on `cores`, the default first; `session` adds ORT's pool on one thread."""
        lowered = ThreadSetting("torch 1 thread", 1)
        unchanged = ThreadSetting(f"torch {cores} threads", cores)
        if cores == 1:
            return [lowered]
        # NOTE: a torch optimizer's update on every core beside ORT's spinning workers is not a
        # candidate of its own: measured idle (5 models, 7 interleaved rounds), it was the slowest
        # way to run the hybrid update on every one (mlp-small 5.02 against 2.73 ms per step, lstm
        # 28.1 against 21.7), as torch's threads wait for the cores ORT's workers hold.
        settings = [lowered, unchanged]
        if session:
            # NOTE: measured idle, 7 models, 2 cores: ORT on one thread won on mlp-small (1.10 against
            # 1.40 ms) and cnn-small (3.52 against 3.63 ms) and lost on the others by 5-17 ms; ORT
            # without spinning never won (resnet-tiny 34.6 against 24.9 ms), so it is not measured.
            settings.append(ThreadSetting("ORT on 1 thread, torch 1 thread", 1, ort_threads=1))
        return settings

    def register(self, trainer: Any, rethread: Callable[[bool, int], None] | None = None) -> None:
        """Be this trainer's policy; `rethread` is the module's route to rerun ORT on other thread settings."""
        self._route = rethread
        others = [c for c in trainer.callbacks if not isinstance(c, ThreadPolicy)]
        trainer.callbacks = [*others, self]

    # ----------------------------------------------------------------------------- a fit
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lower torch's threads (unless the user chose them) and plan the measurements."""
        self.choice, self._trial, self._watch = None, None, None
        self._quiet_hooks()
        active, self.reason = self._should_act()
        if not active:
            self._quiet_hooks("on_train_batch_end", "on_validation_end")
            return
        self._saved = torch.get_num_threads()
        self._rethread = self._route
        self._default = (self.spinning(trainer.strategy), self._cores(trainer.strategy))
        self._candidates = self.candidates(self._default[1], session=session_tunable(trainer, self._route is not None))
        # NOTE: a re-trial is only safe where no other rank has to take the same decision at the same step.
        self._revisits = 1 if self.revisit_factor > 0 and trainer.world_size == 1 and len(self._candidates) > 1 else 0
        if self._kept in self._candidates:
            self._apply(self._kept)
            self.reason = f"measured in an earlier fit of this module: {self._kept.name}"
            self._start_watch()
            return
        skip, why = should_skip_tuning(trainer, self.min_fit_steps)
        if skip or len(self._candidates) == 1:
            self._apply(self._candidates[0])
            self.reason = why if skip else "one candidate on one core"
            self._quiet_hooks("on_train_batch_end", "on_validation_end")
            return
        self._start_trial()

    def _start_trial(self) -> None:
        self._watch = None
        self._trial = Trial.of(len(self._candidates), warmup=self.warmup, block=self.block, rounds=self.rounds)
        self._apply(self._candidates[0])
        self._trial.last = time.perf_counter()

    def _start_watch(self) -> None:
        """Watch the kept setting's step time (once per window of steps), while a revisit is left."""
        if self._revisits and self._kept_seconds > 0:
            window, windows = self.watch
            self._watch = StepWatch(self._kept_seconds * self.revisit_factor, window=window, windows=windows)
        else:
            self._quiet_hooks("on_train_batch_end", "on_validation_end")

    def _quiet_hooks(self, *names: str) -> None:
        """Take `_IDLE_HOOKS` and `names` out of Lightning's dispatch until `restore` (a None attribute is skipped)."""
        for name in (*_IDLE_HOOKS, *names):
            self.__dict__[name] = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Time the batch that ended; apply the next candidate, or the fastest once all are timed."""
        trial = self._trial
        if trial is None:
            watch = self._watch
            if watch is not None and watch.stalled():
                self._revisit(watch)
            return
        now = time.perf_counter()
        timed, counted = trial.plan[trial.ends]
        if timed is not None and counted:
            trial.times[timed].append(now - trial.last)
        trial.ends += 1
        if trial.ends < len(trial.plan):
            upcoming = trial.plan[trial.ends][0]
            self._apply(self._candidates[0 if upcoming is None else upcoming])
        else:
            self._decide(trainer)
        trial.last = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Leave a validation run out of the watched step time."""
        if self._watch is not None:
            self._watch.restart()

    def _revisit(self, watch: StepWatch) -> None:
        self._revisits -= 1
        self.reason = f"revisited: {watch.describe()}"
        log.info("Thread policy: %s; measuring the candidates again", watch.describe())
        self._start_trial()

    def _decide(self, trainer: pl.Trainer) -> None:
        assert self._trial is not None
        medians = torch.tensor([statistics.median(self._trial.times[i]) for i in range(len(self._candidates))])
        # NOTE: every rank must keep the same setting: the choice is made on the ranks' mean times.
        medians = trainer.strategy.reduce(medians, reduce_op="mean")
        best = fastest(medians.tolist(), margin=self.margin)
        self._trial = None
        self._apply(self._candidates[best])
        self._kept, self._kept_seconds = self._candidates[best], medians.tolist()[best]
        pairs = zip(self._candidates, medians.tolist(), strict=True)
        timings = ", ".join(f"{setting.name}: {seconds * 1e3:.2f} ms" for setting, seconds in pairs)
        self.reason = f"measured per step ({timings})"
        if trainer.is_global_zero:
            log.info("Thread policy: %s, the fastest of %s", self._candidates[best].name, timings)
        self._start_watch()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Give torch its thread count back."""
        self.restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Give torch its thread count back when the fit fails."""
        self.restore()

    def restore(self) -> None:
        """Undo what the policy changed (idempotent)."""
        self._trial, self._watch = None, None
        self._rethread = None
        for name in (*_IDLE_HOOKS, "on_train_batch_end", "on_validation_end"):
            self.__dict__.pop(name, None)
        if self._saved is not None:
            torch.set_num_threads(self._saved)
            self._saved = None

    # ----------------------------------------------------------------------------- helpers
    def _should_act(self) -> tuple[bool, str]:
        if self.mode == "off":
            return False, 'threads="off": the thread pools are left as they are'
        if self.mode == "single":
            return False, 'threads="single": ORT on one thread that does not spin, torch\'s threads as they are'
        chosen, why = user_torch_threads()
        if chosen:
            return False, f"torch's threads are the user's: {why}"
        return True, why

    def _apply(self, setting: ThreadSetting) -> None:
        self.choice = setting
        if torch.get_num_threads() != setting.torch_threads:
            torch.set_num_threads(setting.torch_threads)
        if self._rethread is not None:
            spinning, threads = self._default
            self._rethread(spinning, threads if setting.ort_threads is None else setting.ort_threads)
