"""Torch-shaped facades over ONNX Runtime's optimizer and linear LR scheduler.

Lightning only drives what looks like a torch optimizer: `ORTOptimizer` is a
``torch.optim.Optimizer`` whose ``param_groups`` hold the torch views of ORT's parameters
(their ``.grad`` are views of ORT's gradient buffers) and whose ``lr`` is ORT's learning
rate. `LinearLRSchedule` is the linear warmup/decay schedule with ``step``/``state_dict``.

Example::

    >>> # inside an ORTLightningModule: configure_optimizers() returns these
    >>> # {"optimizer": ORTOptimizer(session, params, lr=1e-3),
    >>> #  "lr_scheduler": {"scheduler": LinearLRSchedule(optimizer, warmup_steps=10, total_steps=100),
    >>> #                   "interval": "step"}}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ort_lightning.bridge import hand_over_to_ort
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.runtime import TrainingSession

__all__ = ["LinearLRSchedule", "ORTOptimizer", "linear_lr_factor", "run_closure"]


def run_closure(closure: Callable[[], Any] | None) -> tuple[bool, Any]:
    """Run an optimizer's `closure` with autograd on; ``(False, None)`` when it returned None (skip the update).

    Example::

        >>> run_closure(None), run_closure(lambda: None), run_closure(lambda: 1.5)
        ((True, None), (False, None), (True, 1.5))
    """
    if closure is None:
        return True, None
    with torch.enable_grad():
        loss = closure()
    return loss is not None, loss


class ORTOptimizer(torch.optim.Optimizer):
    """The ORT optimizer (AdamW or SGD graph) seen as a ``torch.optim.Optimizer``.

    ``step(closure)`` runs the closure (ORT forward and backward inside ``training_step``), sends
    ``param_groups[0]["lr"]`` to ORT and runs ORT's update. Moments and the step count live in
    ORT's CheckpointState, not in ``state``. The gradient reset after the update belongs to the
    module's step path (`ort_lightning.training.step.StepPath`).

    Args:
        session: the assembled ORT objects.
        params: torch views of the trainable ORT parameters.
        lr: initial learning rate.
    """

    def __init__(self, session: TrainingSession, params: Iterable[torch.nn.Parameter], *, lr: float) -> None:
        if not lr > 0:
            raise ConfigurationError(f"Expected argument `lr` to be a positive float, but got {lr!r}.")
        super().__init__(list(params), {"lr": float(lr)})
        self.session = session
        session.set_lr(float(lr))
        device = torch.device(session.device)
        # NOTE: ORT's optimizer reads the gradient buffers on its own CUDA stream, while the
        # accumulation scaling, the DDP all-reduce and clipping wrote them on torch's stream.
        self._cuda_device = device if device.type == "cuda" else None

    def follow(self, session: TrainingSession) -> None:
        """Update `session` from now on: a rebuild of the running session (`ort_lightning.training.session.live`).

        ``param_groups`` hold the module's parameters, which a rebuild re-points at the new memory
        (the same objects), and ORT keeps the moments and the step; a scheduler holds this object. The
        lr reaches the new session at the next `step`, as it does every step.
        """
        self.session = session
        device = torch.device(session.device)
        self._cuda_device = device if device.type == "cuda" else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure`, then ORT's optimizer update with the lr of ``param_groups[0]``.

        A closure that returns None (no micro-batch of the step returned a loss, or a NaN/inf
        loss is skipped) skips the update.
        """
        ran, loss = run_closure(closure)
        if not ran:
            return None
        if self._cuda_device is not None:
            hand_over_to_ort(self._cuda_device)
        self.session.set_lr(self.param_groups[0]["lr"])
        self.session.optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ORT's gradient buffers (at the next ``train_step``); ``.grad`` stays the views of them.

        In a fit the module's step path resets after each update instead, and Lightning's own
        ``optimizer_zero_grad`` (which runs after ``training_step``, where ORT has already
        computed the gradients) is a no-op.
        """
        self.session.lazy_reset_grad()


def linear_lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of ORT's LinearLRScheduler after `step` completed optimizer steps.

    Example::

        >>> [linear_lr_factor(s, warmup_steps=2, total_steps=4) for s in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


class LinearLRSchedule:
    """Linear warmup from 0 to `lr`, then linear decay to 0, as a Lightning scheduler over `ORTOptimizer`.

    ``lr(s) = lr * linear_lr_factor(s)`` where `s` counts the scheduler's steps, which Lightning
    takes once per optimizer step, a skipped (NaN/inf) one included, so `s` follows
    ``trainer.global_step`` as a torch scheduler does. A warmup longer than the run stays in the
    warmup (``fast_dev_run``, short ``max_steps``). ``param_groups`` carry the lr for
    ``LearningRateMonitor``, and ORT gets it before every update.

    Args:
        optimizer: the `ORTOptimizer` (or a torch optimizer over ORT's parameters) whose lr it drives.
        warmup_steps: optimizer steps of the warmup.
        total_steps: optimizer steps until the lr reaches 0.
        step: the step to start at (the optimizer steps of a run resumed from an ORT checkpoint).

    Raises:
        ConfigurationError: for ``total_steps < 1`` or a negative warmup or step.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, step: int = 0
    ) -> None:
        if total_steps < 1 or warmup_steps < 0 or step < 0:
            raise ConfigurationError(
                f"Expected total_steps >= 1, warmup_steps >= 0 and step >= 0, but got warmup_steps={warmup_steps}, "
                f"total_steps={total_steps}, step={step}; pass a positive total_steps."
            )
        self.optimizer = optimizer
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.base_lr = float(optimizer.defaults["lr"])
        self.last_step = int(step)
        self._sync()

    @property
    def finished(self) -> bool:
        """Whether every step from here on runs at lr 0 (past the warmup and past `total_steps`)."""
        return self.last_step >= max(self.warmup_steps, self.total_steps)

    def _sync(self) -> None:
        factor = linear_lr_factor(self.last_step, warmup_steps=self.warmup_steps, total_steps=self.total_steps)
        lr = self.base_lr * factor
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if isinstance(self.optimizer, ORTOptimizer):
            self.optimizer.session.set_lr(lr)  # NOTE: so that a checkpoint's "lr" is the next step's

    def step(self) -> None:
        """Move to the next step's lr (Lightning calls it after each optimizer step)."""
        self.last_step += 1
        self._sync()

    def get_last_lr(self) -> list[float]:
        """The lr the next optimizer step will use, one per param group."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The schedule's settings and its step."""
        return {"warmup_steps": self.warmup_steps, "total_steps": self.total_steps, "base_lr": self.base_lr,
                "step": self.last_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step and the peak lr, and recompute the lr (``ckpt_path=`` resume).

        The shape of the schedule (`warmup_steps`, `total_steps`) stays as this fit configured
        it, as torch's ``LambdaLR`` keeps its lambda: a resumed fit with a larger ``max_steps``
        extends the decay instead of staying at lr 0.
        """
        self.base_lr = float(state_dict["base_lr"])
        self.last_step = int(state_dict.get("step", self.last_step))
        self._sync()
