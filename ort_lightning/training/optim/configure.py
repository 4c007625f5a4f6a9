"""What ``ORTLightningModule.configure_optimizers`` returns: the optimizer of a fit and its schedule.

ORT's own optimizer graph (`ORTOptimizer`) by default, or a torch optimizer from the module's
``optimizer=`` factory updating ORT's parameters in place (`ort_lightning.training.optim.hybrid`);
with the ``lr_scheduler=`` schedule, started where the run's checkpoint left it.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts, lr_scheduler="constant")
    >>> type(module.configure_optimizers()).__name__
    'ORTOptimizer'
"""

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
    """The optimizer (with its scheduler config, if any) for ``configure_optimizers``, and the scheduler.

    Args:
        session: the running ORT session.
        params: the trainable parameters (views of ORT's memory).
        artifacts: what is trained (ORT's optimizer needs an optimizer graph).
        factory: None for ORT's optimizer graph, else ``params -> torch.optim.Optimizer``.
        lr: the peak learning rate (ORT's optimizer; a factory sets its own).
        lr_scheduler: the module's ``lr_scheduler=`` option.
        warmup_steps: the linear schedule's warmup, a count or a fraction of the total.
        total_steps: returns the linear schedule's length.
        start: where the schedule starts (the step of the checkpoint the run started from).

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
