"""Training: `ORTLightningModule` and its collaborators.

``module`` (the Lightning hooks, short, delegating), ``session`` (the ORT session, the torch
views of its memory and what pickles), ``step`` (one optimizer step), ``views`` (parameters and
gradients as views of ORT memory), ``optim``,
``hybrid`` and ``schedules`` (optimizers and LR schedules), ``checkpoints``
(checkpoint files; their atomic writes live in `ort_lightning.storage`), ``guards`` and ``metrics``.
"""

from ort_lightning.training.module import ORTLightningModule
from ort_lightning.training.optim import ORTOptimizer

__all__ = ["ORTLightningModule", "ORTOptimizer"]
