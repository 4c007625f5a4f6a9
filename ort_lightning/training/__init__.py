"""Training: `ORTLightningModule` and its collaborators.

``module`` (the Lightning hooks, short, delegating), ``guards`` and ``metrics`` beside it,
``loops`` (a Trainer's fit and epoch loops built anew, the one place that names Lightning's loop
classes), and one room per concern, each importing only the rooms below it:

- ``checkpointing/``: what is written and read (``.ckpt`` contents, ORT checkpoint files, atomic
  ``.ckpt`` writes, `ORTCheckpoint`, `save_pretrained`: back out to transformers and peft); the writes
  themselves live in `ort_lightning.storage`.
- ``threads/``: the thread policy and its trial.
- ``session/``: the ORT session and the torch views of its memory, one optimizer step.
- ``optim/``: ORT and hybrid optimizers, learning-rate schedules.
"""

from ort_lightning.training.checkpointing.pretrained import save_pretrained
from ort_lightning.training.module import ORTLightningModule
from ort_lightning.training.optim.ort_optimizer import ORTOptimizer

__all__ = ["ORTLightningModule", "ORTOptimizer", "save_pretrained"]
