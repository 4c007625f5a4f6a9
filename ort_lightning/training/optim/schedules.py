"""Which learning-rate schedule drives the ORT optimizer: the linear one, none, or a torch one.

A scheduler writes ``param_groups[0]["lr"]``, which reaches ORT before every update. A run resumed
with ``checkpoint=`` takes the linear schedule's missing settings from the checkpoint and starts
every schedule at its step, as if it had not stopped.

Example::

    >>> resolve_warmup(0.1, total_steps=50)
    5
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ort_lightning.errors import ConfigurationError
from ort_lightning.training.optim.hybrid import linear_schedule
from ort_lightning.training.optim.ort_optimizer import LinearLRSchedule, ORTOptimizer

__all__ = [
    "SCHEDULE_PROPERTIES",
    "Progress",
    "Schedule",
    "SchedulerFactory",
    "check_lr_scheduler",
    "check_not_finished",
    "check_schedule",
    "describe",
    "lr_scheduler_config",
    "resolve_schedule",
    "resolve_warmup",
    "planned_schedule_properties",
    "schedule_properties",
    "torch_schedule",
]

#: What ``ORTLightningModule(lr_scheduler=...)`` takes besides the names.
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

_SCHEDULE_NAMES = ("linear", "constant")
#: The keys of Lightning's scheduler dict that a dict `lr_scheduler` may carry.
_CONFIG_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")
_INTERVALS = ("step", "epoch")


def check_lr_scheduler(lr_scheduler: object) -> None:
    """Refuse an `lr_scheduler` that is neither a known name, a callable nor Lightning's dict (`ConfigurationError`)."""
    if isinstance(lr_scheduler, dict):
        _check_config(lr_scheduler)
        return
    if lr_scheduler in _SCHEDULE_NAMES or (callable(lr_scheduler) and not isinstance(lr_scheduler, str)):
        return
    raise ConfigurationError(
        f"Expected argument `lr_scheduler` to be 'linear', 'constant' or a callable optimizer -> "
        f"torch.optim.lr_scheduler.LRScheduler (alone or in Lightning's scheduler dict), but got {lr_scheduler!r}; "
        "for instance lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)."
    )


def _check_config(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    factory = config.get("scheduler")
    interval = config.get("interval", "epoch")
    frequency = config.get("frequency", 1)
    bad_frequency = not isinstance(frequency, int) or frequency < 1
    if unknown or not callable(factory) or interval not in _INTERVALS or bad_frequency:
        raise ConfigurationError(
            f"Expected `lr_scheduler` as a dict to be Lightning's scheduler config with a factory "
            f"optimizer -> scheduler under 'scheduler', keys among {list(_CONFIG_KEYS)}, 'interval' in "
            f"{list(_INTERVALS)} and 'frequency' an int >= 1, but got {config!r}; write e.g. "
            "{'scheduler': lambda opt: ReduceLROnPlateau(opt), 'monitor': 'val_loss', 'interval': 'epoch'}."
        )


def torch_schedule(optimizer: torch.optim.Optimizer, factory: SchedulerFactory) -> torch.optim.lr_scheduler.LRScheduler:
    """Build a torch scheduler over `optimizer` with `factory` (`ConfigurationError` if it returns another thing)."""
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


@dataclass(frozen=True)
class Progress:
    """Where a run starts: optimizer steps and epochs done before it (a start from an ORT checkpoint)."""

    step: int = 0
    epoch: int = 0


def lr_scheduler_config(
    optimizer: torch.optim.Optimizer,
    lr_scheduler: str | SchedulerFactory | dict[str, Any],
    *,
    warmup_steps: int | float,
    total_steps: Callable[[], int],
    start: Progress = Progress(),
) -> dict[str, Any] | None:
    """The ``lr_scheduler`` entry of ``configure_optimizers`` (None for a constant lr).

    A run that starts from a checkpoint starts its schedule at `start` (a torch scheduler stepped
    forward to it); ``ReduceLROnPlateau`` starts afresh. `total_steps` is asked only for ``"linear"``.
    """
    if lr_scheduler == "constant":
        return None
    if isinstance(lr_scheduler, dict):
        config = {**lr_scheduler, "scheduler": torch_schedule(optimizer, lr_scheduler["scheduler"])}
        interval = config.get("interval", "epoch")
        _fast_forward(config["scheduler"], start.step if interval == "step" else start.epoch)
        return config
    scheduler: Any
    if callable(lr_scheduler):
        scheduler = torch_schedule(optimizer, lr_scheduler)
        _fast_forward(scheduler, start.step)
    else:
        total = total_steps()
        warmup = resolve_warmup(warmup_steps, total_steps=total)
        if isinstance(optimizer, ORTOptimizer):
            scheduler = LinearLRSchedule(optimizer, warmup_steps=warmup, total_steps=total, step=start.step)
        else:
            # NOTE: a torch optimizer over ORT's gradients: the same closed form as a torch
            # LambdaLR, which keeps each param group's own peak lr (LinearLRSchedule sets one lr).
            scheduler = linear_schedule(optimizer, warmup_steps=warmup, total_steps=total)
            _fast_forward(scheduler, start.step)
    return {"scheduler": scheduler, "interval": "step"}


def _fast_forward(scheduler: torch.optim.lr_scheduler.LRScheduler, count: int) -> None:
    if count <= 0 or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return
    with warnings.catch_warnings():
        # NOTE: torch warns when a scheduler steps before its optimizer; here that is the point.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(count):
            scheduler.step()


def check_not_finished(scheduler: object) -> None:
    """Refuse a fit whose linear schedule is over before its first step (it would train at lr 0)."""
    if not isinstance(scheduler, LinearLRSchedule) or not scheduler.finished:
        return
    step, total = scheduler.last_step, scheduler.total_steps
    raise ConfigurationError(
        f"The linear lr schedule is over before this fit starts: it is at optimizer step {step} and reaches lr 0 at "
        f"total_steps={total} (warmup_steps={scheduler.warmup_steps}), so every step would run at lr 0 and the "
        f"parameters would not change. To train on, pass total_steps larger than {step} (the schedule continues "
        f"from step {step}, e.g. total_steps={step + total}), pass lr_scheduler='constant', or start a new "
        "schedule from the weights alone (a checkpoint saved with include_optimizer_state=False)."
    )


def describe(lr_scheduler: str | SchedulerFactory | dict[str, Any]) -> str:
    """A name for `lr_scheduler` in the hyper-parameters (a factory is not serializable)."""
    if isinstance(lr_scheduler, str):
        return lr_scheduler
    if isinstance(lr_scheduler, dict):
        options = ", ".join(f"{key}={value!r}" for key, value in lr_scheduler.items() if key != "scheduler")
        return f"{describe(lr_scheduler['scheduler'])} ({options})" if options else describe(lr_scheduler["scheduler"])
    return getattr(lr_scheduler, "__qualname__", type(lr_scheduler).__name__)


def check_schedule(lr: float, warmup_steps: int | float, total_steps: int | None) -> None:
    """Refuse a non-positive lr, a non-positive total or an ill-formed warmup (`ConfigurationError`)."""
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


#: Defaults of the linear schedule when neither the arguments nor a checkpoint say otherwise.
DEFAULT_LR, DEFAULT_WARMUP = 1e-3, 0
#: ORT checkpoint properties that carry the linear schedule of the run that wrote them.
SCHEDULE_PROPERTIES = {
    "lr": "schedule_lr", "warmup_steps": "schedule_warmup_steps", "total_steps": "schedule_total_steps"
}


@dataclass(frozen=True)
class Schedule:
    """The linear schedule's settings: peak lr, warmup (count or fraction) and total (None: estimated)."""

    lr: float
    warmup_steps: int | float
    total_steps: int | None


def resolve_schedule(
    *, lr: float | None, warmup_steps: int | float | None, total_steps: int | None, stored: dict[str, Any]
) -> Schedule:
    """The schedule a run uses: each argument given, else the checkpoint's `stored` value, else the default."""
    given = {"lr": lr, "warmup_steps": warmup_steps, "total_steps": total_steps}
    defaults: dict[str, Any] = {"lr": DEFAULT_LR, "warmup_steps": DEFAULT_WARMUP, "total_steps": None}
    values: dict[str, Any] = {}
    for name, value in given.items():
        key = SCHEDULE_PROPERTIES[name]
        values[name] = value if value is not None else stored.get(key, defaults[name])
    return Schedule(lr=float(values["lr"]), warmup_steps=values["warmup_steps"], total_steps=values["total_steps"])


def schedule_properties(scheduler: object) -> dict[str, int | float | str]:
    """The properties that let a run resumed with ``checkpoint=`` continue `scheduler` (the linear one only)."""
    if not isinstance(scheduler, LinearLRSchedule):
        return {}
    # NOTE: ORT stores float properties as float32; the lr goes as text so that a resume uses the same double.
    return {
        SCHEDULE_PROPERTIES["lr"]: repr(scheduler.base_lr),
        SCHEDULE_PROPERTIES["warmup_steps"]: scheduler.warmup_steps,
        SCHEDULE_PROPERTIES["total_steps"]: scheduler.total_steps,
    }


def planned_schedule_properties(
    *, lr: float, warmup_steps: int | float, total_steps: int | None, lr_scheduler: object, hybrid: bool,
) -> dict[str, int | float | str]:
    """The linear schedule's properties known before a fit builds it (empty where the fit decides them).

    Example::

        >>> planned_schedule_properties(lr=0.1, warmup_steps=2, total_steps=8, lr_scheduler="linear", hybrid=False)
        {'schedule_lr': '0.1', 'schedule_warmup_steps': 2, 'schedule_total_steps': 8}
    """
    if hybrid or lr_scheduler != "linear" or total_steps is None or not isinstance(warmup_steps, int):
        return {}
    return {SCHEDULE_PROPERTIES["lr"]: repr(float(lr)), SCHEDULE_PROPERTIES["warmup_steps"]: warmup_steps,
            SCHEDULE_PROPERTIES["total_steps"]: int(total_steps)}


def total_steps_of(trainer: Any, total_steps: int | None) -> int:
    """`total_steps` if given, else the Trainer's estimate (`ConfigurationError` when neither exists)."""
    if total_steps is not None:
        return int(total_steps)
    estimated = trainer.estimated_stepping_batches
    # NOTE: Lightning estimates inf for an infinite dataloader without max_steps, and max_steps (-1 when
    # unset) for a dataloader without a length (an IterableDataset) under max_epochs.
    if estimated == float("inf") or estimated < 1:
        raise ConfigurationError(
            "The Trainer cannot estimate the number of optimizer steps of this run (a dataloader without a length, "
            "such as an IterableDataset, and no Trainer(max_steps=...)), and the linear lr schedule needs it to "
            "decay to 0 at total_steps; pass ORTLightningModule(total_steps=...), set Trainer(max_steps=...), or "
            "pass lr_scheduler='constant'."
        )
    return int(estimated)
