"""Which learning-rate schedule drives the ORT optimizer: ORT's linear one, none, or a torch one.

``ORTLightningModule(lr_scheduler=...)`` takes ``"linear"`` (ORT's LinearLRScheduler, the
default), ``"constant"``, or a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``.
A torch scheduler writes ``param_groups[0]["lr"]``, which `ORTOptimizer.step` hands to ORT
before every update.

Example::

    >>> resolve_warmup(0.1, total_steps=50)
    5
    >>> describe(lambda opt: None)
    '<lambda>'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ort_lightning._hybrid import linear_schedule
from ort_lightning.errors import ConfigurationError
from ort_lightning.optim import LinearLRSchedule, ORTOptimizer

__all__ = [
    "SchedulerFactory",
    "check_lr_scheduler",
    "check_schedule",
    "describe",
    "lr_scheduler_config",
    "resolve_warmup",
    "torch_schedule",
]

#: What ``ORTLightningModule(lr_scheduler=...)`` takes besides the names.
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

_SCHEDULE_NAMES = ("linear", "constant")


def check_lr_scheduler(lr_scheduler: object) -> None:
    """Refuse an `lr_scheduler` option that is neither a known name nor a callable.

    Raises:
        ConfigurationError: naming what is accepted.
    """
    if lr_scheduler in _SCHEDULE_NAMES or (callable(lr_scheduler) and not isinstance(lr_scheduler, str)):
        return
    raise ConfigurationError(
        f"Expected argument `lr_scheduler` to be 'linear', 'constant' or a callable optimizer -> "
        f"torch.optim.lr_scheduler.LRScheduler, but got {lr_scheduler!r}; for instance "
        "lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)."
    )


def torch_schedule(optimizer: torch.optim.Optimizer, factory: SchedulerFactory) -> torch.optim.lr_scheduler.LRScheduler:
    """Build a torch scheduler over `optimizer` with `factory`; its lr reaches ORT before every update.

    Raises:
        ConfigurationError: when `factory` returns something other than an ``LRScheduler`` of `optimizer`.
    """
    scheduler = factory(optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or scheduler.optimizer is not optimizer:
        raise ConfigurationError(
            f"Expected `lr_scheduler` to return a torch.optim.lr_scheduler.LRScheduler built on the optimizer "
            f"it is given, but it returned {type(scheduler).__name__}; write e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10)."
        )
    return scheduler


def resolve_warmup(warmup_steps: int | float, *, total_steps: int) -> int:
    """A warmup given as a fraction in (0, 1) of `total_steps`, or as a count."""
    if isinstance(warmup_steps, float) and warmup_steps < 1:
        return round(warmup_steps * total_steps)
    return int(warmup_steps)


def lr_scheduler_config(
    optimizer: torch.optim.Optimizer,
    lr_scheduler: str | SchedulerFactory,
    *,
    warmup_steps: int | float,
    total_steps: Callable[[], int],
) -> dict[str, Any] | None:
    """The ``lr_scheduler`` entry of ``configure_optimizers`` (None for a constant lr), stepped per step.

    Args:
        optimizer: the ORT optimizer facade, or the torch optimizer of hybrid training.
        lr_scheduler: ``"linear"``, ``"constant"`` or a torch scheduler factory.
        warmup_steps: the linear schedule's warmup, a count or a fraction of the total.
        total_steps: returns the linear schedule's length (asked only for ``"linear"``).
    """
    if lr_scheduler == "constant":
        return None
    scheduler: Any
    if callable(lr_scheduler):
        scheduler = torch_schedule(optimizer, lr_scheduler)
    else:
        total = total_steps()
        warmup = resolve_warmup(warmup_steps, total_steps=total)
        if isinstance(optimizer, ORTOptimizer):
            scheduler = LinearLRSchedule(optimizer, warmup_steps=warmup, total_steps=total)
        else:  # a torch optimizer over ORT's gradients: the same closed form, as a torch scheduler
            scheduler = linear_schedule(optimizer, warmup_steps=warmup, total_steps=total)
    return {"scheduler": scheduler, "interval": "step"}


def describe(lr_scheduler: str | SchedulerFactory) -> str:
    """A name for `lr_scheduler` in the hyper-parameters (a factory is not serializable)."""
    if isinstance(lr_scheduler, str):
        return lr_scheduler
    return getattr(lr_scheduler, "__qualname__", type(lr_scheduler).__name__)


def check_schedule(lr: float, warmup_steps: int | float, total_steps: int | None) -> None:
    """Refuse a non-positive lr, a non-positive total or a negative/ill-formed warmup.

    Raises:
        ConfigurationError: naming the argument and what it accepts.
    """
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigurationError(
            f"Expected argument `lr` to be a positive float, but got {lr!r}; pass the peak learning rate, e.g. lr=1e-3."
        )
    if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
        raise ConfigurationError(
            f"Expected argument `total_steps` to be a positive int or None, but got {total_steps!r}; pass None to "
            "use the Trainer's estimated number of optimizer steps."
        )
    if isinstance(warmup_steps, float) and not warmup_steps.is_integer() and not 0 < warmup_steps < 1:
        raise ConfigurationError(
            f"Expected `warmup_steps` as a count (int >= 0) or a fraction in (0, 1), but got {warmup_steps!r}; "
            "pass e.g. warmup_steps=100 or warmup_steps=0.1 (10% of total_steps)."
        )
    if warmup_steps < 0:
        raise ConfigurationError(
            f"Expected `warmup_steps` >= 0, but got {warmup_steps!r}; pass 0 for no warmup."
        )


def total_steps_of(trainer: Any, total_steps: int | None) -> int:
    """`total_steps` if given, else the Trainer's estimate of the optimizer steps of the run.

    Raises:
        ConfigurationError: when neither exists (an infinite dataloader without ``max_steps``).
    """
    if total_steps is not None:
        return int(total_steps)
    estimated = trainer.estimated_stepping_batches
    if estimated == float("inf"):
        raise ConfigurationError(
            "The Trainer cannot estimate the number of optimizer steps (infinite dataloader and no "
            "max_steps); pass ORTLightningModule(total_steps=...) or set Trainer(max_steps=...)."
        )
    return int(estimated)
