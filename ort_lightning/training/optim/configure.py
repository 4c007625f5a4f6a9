"""What ``ORTLightningModule.configure_optimizers`` returns: the optimizer of a fit and its schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.ort.runtime import TrainingSession
from ort_lightning.training.guards import check_can_train
from ort_lightning.training.optim import hybrid as _hybrid
from ort_lightning.training.optim.ort_optimizer import ORTOptimizer
from ort_lightning.training.optim.schedules import Progress, lr_scheduler_config

__all__ = ["configure"]


def configure(
    session: TrainingSession,
    params: Sequence[torch.nn.Parameter],
    artifacts: TrainingArtifacts,
    *,
    factory: _hybrid.OptimizerFactory | None,
    lr: float,
    lr_scheduler: Any,
    warmup_steps: int | float,
    total_steps: Callable[[], int],
    start: Progress,
) -> tuple[Any, Any]:
    """The optimizer (with its scheduler config) for ``configure_optimizers``, and the scheduler.

    `factory` None runs ORT's optimizer graph at `lr`; else it builds a torch optimizer over `params`.
    The schedule starts at `start`.

    Raises:
        ConfigurationError: for artifacts without an optimizer graph and no factory, or a factory
            that does not return a torch optimizer over `params`.
    """
    optimizer: torch.optim.Optimizer
    if factory is None:
        check_can_train(artifacts)
        optimizer = ORTOptimizer(session, params, lr=lr)
    else:
        optimizer = _hybrid.build(factory, session, params)
    config = lr_scheduler_config(optimizer, lr_scheduler, warmup_steps=warmup_steps, total_steps=total_steps,
                                 start=start)
    if config is None:
        return optimizer, None
    return {"optimizer": optimizer, "lr_scheduler": config}, config["scheduler"]
