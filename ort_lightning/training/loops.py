"""The one place that builds a ``Trainer``'s fit and epoch loops: Lightning's private loop classes.

A ``Trainer`` counts the epochs and steps of every fit it ran in its fit loop
(``trainer.fit_loop``) and that loop's epoch loop (``fit_loop.epoch_loop``); a second ``fit`` of
the same Trainer starts where the first one stopped and, past ``max_epochs``, does not train.
Lightning has no public way to start them over: ``Trainer.__init__`` builds them as
``_FitLoop(trainer, min_epochs=, max_epochs=)`` and ``_TrainingEpochLoop(trainer, min_steps=,
max_steps=)``, private classes. `fresh_loops` builds them the same way, from the limits the old
loops hold, so that a Trainer reused for many fits (a fleet worker's devices) counts each fit
from 0 as a new Trainer does. Nothing else in the package names a loop class or constructor.

Read against lightning 2.6.6 (``lightning/pytorch/trainer/trainer.py``, where ``Trainer.__init__``
builds the loops, ``loops/fit_loop.py`` and ``loops/training_epoch_loop.py``). `LOOPS` lists what
this module relies on: where each loop is held, and the limits its constructor takes and the loop
keeps under the same names; ``tests/training/test_lightning_private.py`` checks them against the installed
lightning (constructor parameters, attributes, a second fit) and fails naming the one that moved.

Example::

    >>> import lightning.pytorch as pl
    >>> trainer = pl.Trainer(max_epochs=2, max_steps=5, logger=False, enable_progress_bar=False,
    ...                      enable_model_summary=False, enable_checkpointing=False)
    >>> old = trainer.fit_loop
    >>> fresh_loops(trainer)
    >>> trainer.fit_loop is old, trainer.max_epochs, trainer.max_steps, trainer.global_step
    (False, 2, 5, 0)
    >>> LOOPS["epoch_loop"]
    ('min_steps', 'max_steps')
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["LIGHTNING_READ", "LOOPS", "fresh_loops"]

#: The lightning release whose loops this module was read against.
LIGHTNING_READ = "2.6.6"

#: Each loop by the attribute that holds it (``trainer.fit_loop``, ``trainer.fit_loop.epoch_loop``),
#: with the limits its class's constructor takes after ``trainer`` as keywords, each kept on the loop
#: under the same name.
LOOPS: dict[str, tuple[str, ...]] = {
    "fit_loop": ("min_epochs", "max_epochs"),
    "epoch_loop": ("min_steps", "max_steps"),
}


def fresh_loops(trainer: pl.Trainer) -> None:
    """Give `trainer` a fit loop and an epoch loop like the ones it holds, their progress at 0.

    Args:
        trainer: a Trainer, fitted or not; its loops are replaced, their limits kept.
    """
    old = trainer.fit_loop
    loop = _like(old, "fit_loop", trainer)
    loop.epoch_loop = _like(old.epoch_loop, "epoch_loop", trainer)
    trainer.fit_loop = loop


def _like(loop: Any, held_as: str, trainer: pl.Trainer) -> Any:
    # NOTE: the loop's own class, so that a Trainer subclass's loops stay its own.
    return type(loop)(trainer, **{limit: getattr(loop, limit) for limit in LOOPS[held_as]})
