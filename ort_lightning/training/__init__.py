"""Training: `ORTLightningModule` and its collaborators.

``module`` (the Lightning hooks, short, delegating), ``step`` (one optimizer step), ``views``
(torch tensors that are views of ORT memory), ``portable`` (pickling them), ``optim``,
``hybrid`` and ``schedules`` (optimizers and LR schedules), ``checkpoints`` and ``atomic``
(checkpoint files), ``guards`` and ``metrics``.
"""

from ort_lightning.training.module import ORTLightningModule
from ort_lightning.training.optim import ORTOptimizer

__all__ = ["ORTLightningModule", "ORTOptimizer"]
