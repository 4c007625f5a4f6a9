"""A folder whose optimizer graph computes its own learning rate: the module trains it only at that rate.

The module's scheduler still reports a rate (to ``LearningRateMonitor``, checkpoints), which the
graph would silently ignore; `check_graph_schedule` accepts only the settings that report the
rate the graph trains at.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.schedule import GraphSchedule
from ort_lightning.errors import ConfigurationError
from ort_lightning.training.optim.schedules import Schedule, check_schedule, describe, resolve_schedule, resolve_warmup

__all__ = ["agrees", "check_graph_schedule", "module_schedule"]


def agrees(baked: GraphSchedule, schedule: Schedule, lr_scheduler: Any) -> bool:
    """Whether the module's `schedule` and `lr_scheduler` give, step by step, the rate `baked` computes."""
    if lr_scheduler != baked.kind or not math.isclose(schedule.lr, baked.lr, rel_tol=1e-12):
        return False
    if baked.kind == "constant":
        return True
    total = schedule.total_steps
    if total is None or total != baked.total_steps:
        return False
    return resolve_warmup(schedule.warmup_steps, total_steps=total) == baked.warmup_steps


def check_graph_schedule(
    baked: GraphSchedule | None, schedule: Schedule, lr_scheduler: Any, *, folder: Path, on_nonfinite: str,
    hybrid: bool,
) -> None:
    """Refuse settings whose rate is not `folder`'s graph's (a hybrid module, which runs no graph, passes).

    Raises:
        ConfigurationError: naming the folder's schedule and the arguments that train at it.
    """
    if baked is None or hybrid:
        return
    if not agrees(baked, schedule, lr_scheduler):
        raise ConfigurationError(
            f"{folder} computes its learning rate in its optimizer graph ({baked.describe()}; prepare_for_web() "
            f"wrote it) and ignores the rate ORTLightningModule sets, but this module was given lr={schedule.lr!r}, "
            f"lr_scheduler={describe(lr_scheduler)!r}, warmup_steps={schedule.warmup_steps!r}, "
            f"total_steps={schedule.total_steps!r}: it would report one rate and train at another. Pass "
            f"{baked.arguments()} to train at the folder's schedule, or train the folder that prepare_for_web() "
            "read, which takes any schedule."
        )
    if baked.kind == "linear" and on_nonfinite == "skip":
        raise ConfigurationError(
            f"{folder} computes a linear learning-rate schedule from ONNX Runtime's count of updates, which a skipped "
            "step does not advance, while the module's schedule counts every optimizer step: with "
            "on_nonfinite='skip' the two would part after the first skipped step. Pass on_nonfinite='raise', or "
            "train the folder that prepare_for_web() read."
        )


def module_schedule(
    artifacts: TrainingArtifacts, *, lr: float | None, warmup_steps: int | float | None, total_steps: int | None,
    stored: dict[str, Any], lr_scheduler: Any, on_nonfinite: str, hybrid: bool,
) -> Schedule:
    """The module's schedule (arguments, else the `stored` checkpoint's, else defaults), checked."""
    schedule = resolve_schedule(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, stored=stored)
    check_schedule(schedule.lr, schedule.warmup_steps, schedule.total_steps)
    check_graph_schedule(artifacts.manifest.lr_schedule, schedule, lr_scheduler, folder=artifacts.directory,
                         on_nonfinite=on_nonfinite, hybrid=hybrid)
    return schedule
