"""Torch-shaped facades over ONNX Runtime's optimizer and linear LR scheduler, for Lightning to drive."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ort_lightning.bridge import hand_over_to_ort
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.runtime import TrainingSession

__all__ = ["LinearLRSchedule", "ORTOptimizer", "linear_lr_factor", "run_closure"]


def run_closure(closure: Callable[[], Any] | None) -> tuple[bool, Any]:
    """Run an optimizer's `closure` with autograd on; ``(False, None)`` when it returned None (skip the update)."""
    if closure is None:
        return True, None
    with torch.enable_grad():
        loss = closure()
    return loss is not None, loss


class ORTOptimizer(torch.optim.Optimizer):
    """The ORT optimizer (AdamW or SGD graph) seen as a ``torch.optim.Optimizer``.

    ``param_groups`` hold the torch views of ORT's parameters; moments and step live in ORT's
    CheckpointState. ``step`` sends ``param_groups[0]["lr"]`` to ORT and runs its update.
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
        """Update `session` from now on (a rebuild); the parameters are the same objects, re-pointed."""
        self.session = session
        device = torch.device(session.device)
        self._cuda_device = device if device.type == "cuda" else None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure`, then ORT's update at ``param_groups[0]``'s lr; a closure that returns None skips it."""
        ran, loss = run_closure(closure)
        if not ran:
            return None
        if self._cuda_device is not None:
            hand_over_to_ort(self._cuda_device)
        self.session.set_lr(self.param_groups[0]["lr"])
        self.session.optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ORT's gradient buffers (at the next ``train_step``); ``.grad`` stays the views of them."""
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

    It counts Lightning's optimizer steps (skipped ones included), as a torch scheduler does; a
    warmup longer than the run stays in the warmup. `step` is where a resumed run starts.

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
        """Restore the step and the peak lr (``ckpt_path=`` resume); the shape stays as this fit configured it."""
        self.base_lr = float(state_dict["base_lr"])
        self.last_step = int(state_dict.get("step", self.last_step))
        self._sync()
