"""One optimizer step of ORT training, read top to bottom in `StepPath.step`.

In order: run the closure (ORT's forward and backward for the last micro-batch), mark the
window, scale (ORT sums, Lightning averages), re-bind the gradient views, decide a NaN/inf skip
on all ranks together, let Lightning all-reduce and clip, update, reset ORT's gradients. Per
micro-batch, `StepPath.train` seeds ORT's random stream from the run's seed and the micro-batch's
place, so that a resumed run draws what the uninterrupted one would have.

Example::

    >>> seed_of(7, step=3, micro_batch=0) != seed_of(7, step=4, micro_batch=0)
    True
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_lightning.bridge import BatchBinder, LabelRange
from ort_lightning.errors import ConfigurationError, NonFiniteLossError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.session.finite import FiniteCheck, nonfinite_parameters
from ort_lightning.training.session.parameters import GradientViews

__all__ = ["POLICIES", "NonFiniteGuard", "StepPath", "seed_of"]

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


#: What `ORTLightningModule(on_nonfinite=...)` accepts.
POLICIES = ("raise", "skip")

_ADVICE = (
    "lower the lr, check the data for NaN/inf values (and for batches whose labels are all ignore_index: their mean "
    "loss is NaN, as in torch), or pass ORTLightningModule(on_nonfinite='skip')"
)


class NonFiniteGuard:
    """Watch each training loss; refuse or drop the optimizer step that a NaN/inf loss would poison.

    Decided once per optimizer step and shared by all ranks, before the all-reduce and the update.
    `policy` is ``"raise"`` (`NonFiniteLossError`) or ``"skip"`` (drop the step and warn).

    Raises:
        ConfigurationError: for another policy.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ConfigurationError(
                f"Expected argument `on_nonfinite` to be one of {list(POLICIES)}, but got {policy!r}; "
                "'raise' stops training at a NaN/inf loss, 'skip' drops that optimizer step and warns."
            )
        self.policy = policy
        self.skipped = 0
        self._pending: str | None = None

    def observe(self, loss: torch.Tensor, trainer: Any, batch_idx: int) -> None:
        """Check one micro-batch's loss; the `trainer`'s progress names the step in messages."""
        # NOTE: the loss is a 0-d view of ORT's output; .item() reads one number (ORT's run has
        # already finished, so this adds no wait on a GPU either).
        value = loss.item()
        if not math.isfinite(value) and self._pending is None:
            self._pending = f"{value} {_where(trainer, batch_idx)}"

    def decide(self, trainer: Any, *, parameters_finite: Callable[[], bool] = lambda: True) -> bool:
        """Whether this optimizer step is skipped; every rank gets the same answer.

        Raises:
            NonFiniteLossError: under ``"raise"`` when any rank saw a NaN/inf loss, or under either
                policy when an earlier update left NaN/inf in the parameters.
        """
        pending, self._pending = self._pending, None
        bad = pending is not None
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return False
        # NOTE: every rank is here together and holds the same parameters, so all raise or none does.
        if not parameters_finite():
            raise nonfinite_parameters(trainer, update=trainer.global_step - 1)
        where = pending or f"non-finite on another rank at global_step={trainer.global_step}"
        if self.policy == "raise":
            raise NonFiniteLossError(
                f"The training loss is {where}; ORT's optimizer update has not run, so the parameters are "
                f"still finite. To go on: {_ADVICE}."
            )
        self.skipped += 1
        warnings.warn(
            f"Skipped an optimizer step: the loss was {where}. The parameters and the optimizer state are "
            f"unchanged and the gradients were reset ({self.skipped} step(s) skipped so far); if this repeats, "
            "lower the lr or check the data for NaN/inf values.",
            RuntimeWarning,
            stacklevel=2,
        )
        return True


def _where(trainer: Any, batch_idx: int) -> str:
    return f"at global_step={trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"


class _Window:
    """The micro-batches of one accumulation window; kept apart, gradients wait in `sum` until they count."""

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
        keep_apart: keep each micro-batch's gradients apart under accumulation.
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
        self._train_step: Callable[[Any], Any] | None = None
        self._binder: BatchBinder | None = None
        self._gradients = GradientViews(())
        self._finite = FiniteCheck(())

    def __getstate__(self) -> dict[str, Any]:
        """Leave ORT's objects out of a pickle; the module attaches the rebuilt ones."""
        state = dict(self.__dict__)
        state.update(_session=None, _train_step=None, _binder=None, _gradients=GradientViews(()), _window=_Window(),
                     _finite=FiniteCheck(()))
        return state

    def continue_run(self, step: int, seed: int | None) -> None:
        """Count on from `step` optimizer steps (a run resumed from a checkpoint), with its `seed` when recorded."""
        self.step_offset = step
        if seed is not None:
            self.seed = seed

    def seed_in_use(self) -> int:
        """The run's seed: Lightning's, else the module's own (drawn from torch or restored)."""
        base = lightning_seed()
        return self.seed if base is None else base

    def attach(self, session: _ort.TrainingSession, gradients: GradientViews, binder: BatchBinder) -> None:
        """Work on a (re)built session: its training step, gradient views and binder (called by `LiveSession`)."""
        self._session, self._gradients, self._binder = session, gradients, binder
        self._train_step = session.train_step
        self._window = _Window()
        self._finite = FiniteCheck([parameter for parameter, _ in gradients.pairs])

    # ----------------------------------------------------------------------------- per micro-batch
    def train(
        self, batch: Any, trainer: Any, batch_idx: int, labels: LabelRange | None
    ) -> tuple[Sequence[torch.Tensor], Any, torch.Tensor]:
        """ORT's forward and backward on one micro-batch; return its tensors, fetches and loss."""
        self.before_graph(trainer, batch_idx)
        assert self._train_step is not None, "attach() a session first"
        assert self._binder is not None, "attach() a session first"
        tensors, fetches, loss = self._binder.step(self._train_step, batch, labels)
        self.nonfinite.observe(loss, trainer, batch_idx)
        return tensors, fetches, loss

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
        if counted and accumulate > 1 and self._gradients.grads:
            torch._foreach_mul_(self._gradients.grads, 1.0 / accumulate)  # 3. scale: ORT sums, Lightning averages
        self._rebind()  # 4. re-bind the views of ORT's buffers
        if self.nonfinite.decide(trainer, parameters_finite=self._finite.holds):  # 5. skip, decided by all ranks
            return None
        if result is None and counted:
            return _WINDOW_LOSS
        return result

    def check_parameters(self, trainer: Any) -> None:
        """Stop the fit if the last update left NaN/inf in the parameters (`NonFiniteLossError`)."""
        if trainer.global_step > 0 and not self._finite.holds():
            raise nonfinite_parameters(trainer, update=trainer.global_step - 1)

    def reset(self) -> None:
        """Restart ORT's gradient buffers at the next micro-batch and the window's bookkeeping."""
        if self._session is not None:
            self._session.lazy_reset_grad()
        self._rebind()
        self._window.restart()

    def _rebind(self) -> None:
        """Give every parameter its gradient view back where something replaced or cleared it."""
        for parameter, grad in self._gradients.pairs:
            if parameter.grad is not grad:
                parameter.grad = grad
