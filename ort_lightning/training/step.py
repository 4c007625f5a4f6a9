"""One optimizer step of ORT training, read top to bottom in `StepPath.step`.

Lightning drives a step through ``LightningModule.optimizer_step``; `ORTLightningModule`
hands it to `StepPath.step`, which runs, in order:

1. **run**: the optimizer calls the closure, and Lightning's closure runs ``training_step``
   (ORT's forward and backward) for the window's last micro-batch;
2. **mark the window**: whether any micro-batch of the accumulation window returned a loss
   (a torch optimizer steps on the earlier micro-batches' gradients too);
3. **scale**: ORT sums gradients over micro-batches, Lightning expects their mean (``1/N``);
4. **re-bind**: every ``.grad`` is the view of ORT's gradient buffer again;
5. **decide skip, collectively**: a NaN/inf loss on any rank skips (or raises) on every rank,
   through ``trainer.strategy.reduce_boolean_decision``;
6. **all-reduce, clip**: Lightning's strategy (``ort_ddp`` averages the gradients) and precision
   plugin (``on_before_optimizer_step``, gradient clipping) run right after the closure returns;
7. **update**: ``optimizer.step`` itself, the one place where parameters change: ORT's
   optimizer graph for `ORTOptimizer`, or any torch optimizer over the same views;
8. **reset**: ORT's gradient buffers restart at the next micro-batch.

Per micro-batch, `StepPath.before_graph` seeds ORT's random stream (dropout) from the run's
seed and the micro-batch's place in training, so that a resumed run draws what the
uninterrupted one would have drawn.

Example::

    >>> seed_of(7, step=3, micro_batch=0) == seed_of(7, step=3, micro_batch=0)
    True
    >>> seed_of(7, step=3, micro_batch=0) != seed_of(7, step=4, micro_batch=0)
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ort_lightning.ort import runtime as _ort
from ort_lightning.training.guards import NonFiniteGuard
from ort_lightning.training.views import GradientViews

__all__ = ["StepPath", "seed_of"]

#: What the closure gives the optimizer when the last micro-batch was dropped but earlier ones count.
_WINDOW_LOSS = torch.zeros(())

_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: neighbouring inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seed_of(base: int, *, step: int, micro_batch: int) -> int:
    """ORT's seed for one micro-batch: a hash of the run's seed, the optimizer step and the micro-batch."""
    return _mix(_mix(_mix(base & _MASK64) ^ step) ^ micro_batch) >> 1  # ORT takes a signed 64-bit seed


def lightning_seed() -> int | None:
    """The seed of Lightning's ``seed_everything`` in this process, or None."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return None if seed is None else int(seed)


class _Window:
    """The micro-batches of one accumulation window.

    `counted` is set when any micro-batch returned a loss. When a ``training_step`` may run
    ORT's graph and still return None (an overridden ``training_step`` under accumulation),
    each micro-batch's gradients are kept apart in `sum` until it is known to count, so that a
    dropped micro-batch leaves no trace, as with torch (where its ``backward`` never runs).
    """

    def __init__(self) -> None:
        self.counted = False  # a micro-batch of this window returned a loss
        self.ran = False  # the current micro-batch ran ORT's training graph
        self.current_counts = False  # ... and returned a loss
        self.sum: list[torch.Tensor] = []  # the counted earlier micro-batches' gradients
        self.sum_holds = False

    def fold(self, grads: list[torch.Tensor]) -> None:
        """Add the finished micro-batch's gradients to `sum` when it counted."""
        if self.ran and self.current_counts:
            if not self.sum:
                self.sum = [torch.empty_like(g) for g in grads]  # NOTE: once per session, not per step
            if self.sum_holds:
                torch._foreach_add_(self.sum, grads)
            else:
                torch._foreach_copy_(self.sum, grads)
            self.sum_holds = True
        self.ran, self.current_counts = False, False

    def close(self, grads: list[torch.Tensor]) -> None:
        """Leave the window's counted gradients in ORT's buffers (kept-apart mode)."""
        if self.sum_holds:
            if self.ran and self.current_counts:
                torch._foreach_add_(grads, self.sum)
            else:
                torch._foreach_copy_(grads, self.sum)

    def restart(self) -> None:
        self.counted = self.ran = self.current_counts = self.sum_holds = False


class StepPath:
    """The optimizer step of an `ORTLightningModule` and the per-micro-batch work around it.

    Args:
        nonfinite: the NaN/inf loss policy.
        keep_apart: keep each micro-batch's gradients apart under accumulation (a subclass's
            ``training_step`` may run the graph, then return None).
        seed: the run's seed when Lightning's ``seed_everything`` did not set one.
    """

    def __init__(self, nonfinite: NonFiniteGuard, *, keep_apart: bool, seed: int) -> None:
        self.nonfinite = nonfinite
        self.keep_apart = keep_apart
        # NOTE: torch's unseeded initial seed may use all 64 bits; checkpoints store a signed int64.
        self.seed = seed & (_MASK64 >> 1)
        self.step_offset = 0  # optimizer steps before this run (a start from an ORT checkpoint)
        self._window = _Window()
        self._session: _ort.TrainingSession | None = None
        self._gradients = GradientViews(())

    def __getstate__(self) -> dict[str, Any]:
        """Leave ORT's objects out of a pickle; the module attaches the rebuilt ones."""
        state = dict(self.__dict__)
        state.update(_session=None, _gradients=GradientViews(()), _window=_Window())
        return state

    def seed_in_use(self) -> int:
        """The run's seed: Lightning's, else the module's own (drawn from torch or restored)."""
        base = lightning_seed()
        return self.seed if base is None else base

    def attach(self, session: _ort.TrainingSession, gradients: GradientViews) -> None:
        """Work on a (re)built session and its gradient views."""
        self._session, self._gradients = session, gradients
        self._window = _Window()

    # ----------------------------------------------------------------------------- per micro-batch
    def before_graph(self, trainer: Any, batch_idx: int) -> None:
        """Before ORT's forward and backward: seed ORT's random stream; keep earlier gradients apart."""
        accumulate = trainer.accumulate_grad_batches
        step = self.step_offset + trainer.global_step
        _ort.set_seed(seed_of(self.seed_in_use(), step=step, micro_batch=batch_idx % accumulate))
        if self.keep_apart and accumulate > 1:
            assert self._session is not None
            self._window.fold(self._gradients.grads)
            self._session.lazy_reset_grad()  # ORT's buffers hold this micro-batch alone
        self._window.ran = True

    def counted(self) -> None:
        """This micro-batch returned a loss (Lightning calls ``backward`` only then)."""
        self._window.counted = self._window.current_counts = True

    # ----------------------------------------------------------------------------- per optimizer step
    def step(self, optimizer: Any, closure: Callable[[], Any] | None, trainer: Any) -> None:
        """One optimizer step: the closure (run, mark, scale, re-bind, decide), update, reset."""
        try:
            if closure is None:
                optimizer.step()
            else:
                optimizer.step(closure=lambda: self._close_window(closure, trainer))  # 7. update
        finally:
            self.reset()  # 8. reset

    def _close_window(self, closure: Callable[[], Any], trainer: Any) -> Any:
        result = closure()  # 1. run: training_step of the window's last micro-batch
        window = self._window
        counted = window.counted  # 2. mark: any micro-batch of the window returned a loss
        if self.keep_apart:
            window.close(self._gradients.grads)
        accumulate = trainer.accumulate_grad_batches
        if counted and accumulate > 1:
            self._gradients.scale(1.0 / accumulate)  # 3. scale: ORT sums, Lightning averages
        self._gradients.rebind()  # 4. re-bind the views of ORT's buffers
        if self.nonfinite.decide(trainer):  # 5. skip, decided by all ranks together
            return None
        if result is None and counted:
            return _WINDOW_LOSS
        return result

    def reset(self) -> None:
        """Restart ORT's gradient buffers at the next micro-batch and the window's bookkeeping."""
        if self._session is not None:
            self._session.lazy_reset_grad()
        self._gradients.rebind()
        self._window.restart()
