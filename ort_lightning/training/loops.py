"""The one place that builds a ``Trainer``'s fit and epoch loops: Lightning's private loop classes.

A second ``fit`` of a Trainer starts where the first stopped, and Lightning has no public way to
start its loops over; `fresh_loops` builds them as ``Trainer.__init__`` does, so that a Trainer
reused for many fits (a fleet worker's) counts each from 0. `LOOPS` lists what this relies on;
``tests/test_lightning_private.py`` checks it against the installed lightning.
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

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(max_epochs=2, max_steps=5, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False)
        >>> fresh_loops(trainer)
        >>> trainer.max_epochs, trainer.max_steps, trainer.global_step
        (2, 5, 0)
    """
    old = trainer.fit_loop
    loop = _like(old, "fit_loop", trainer)
    loop.epoch_loop = _like(old.epoch_loop, "epoch_loop", trainer)
    trainer.fit_loop = loop


def _like(loop: Any, held_as: str, trainer: pl.Trainer) -> Any:
    # NOTE: the loop's own class, so that a Trainer subclass's loops stay its own.
    return type(loop)(trainer, **{limit: getattr(loop, limit) for limit in LOOPS[held_as]})
