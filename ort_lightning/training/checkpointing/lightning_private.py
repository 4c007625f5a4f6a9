"""The one place that touches `ModelCheckpoint`'s private methods and fields.

`ModelCheckpointAdapter` overrides each private file method in a line or two and hands over to a
public-named one, so ``ORTCheckpoint`` is written against public names only. `OVERRIDDEN` and
`FIELDS` list what this relies on; ``tests/test_lightning_private.py`` checks them against the
installed lightning.
"""

from __future__ import annotations

from typing import Any
from weakref import proxy

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from typing_extensions import override

__all__ = ["FIELDS", "LIGHTNING_READ", "OVERRIDDEN", "ModelCheckpointAdapter"]

#: The lightning release whose ``ModelCheckpoint`` this module was read against.
LIGHTNING_READ = "2.6.6"

#: Each private ``ModelCheckpoint`` method overridden here, with its parameters as read.
OVERRIDDEN: dict[str, tuple[str, ...]] = {
    "_save_checkpoint": ("self", "trainer", "filepath"),
    "_remove_checkpoint": ("self", "trainer", "filepath"),
    "_find_last_checkpoints": ("self", "trainer"),
    "_monitor_candidates": ("self", "trainer"),
    "_save_topk_checkpoint": ("self", "trainer", "monitor_candidates"),
}

#: Each private ``ModelCheckpoint`` field read or written here.
FIELDS = ("_last_global_step_saved", "_last_checkpoint_saved", "_every_n_train_steps", "_every_n_epochs",
          "_train_time_interval")


class ModelCheckpointAdapter(ModelCheckpoint):
    """``ModelCheckpoint`` whose private file access calls public-named methods; a subclass defines `write_file`."""

    # ----------------------------------------------------------------------------- what a subclass defines
    def write_file(self, trainer: pl.Trainer, filepath: str) -> None:
        """Write the checkpoint file `filepath`; every rank calls it, as ``ModelCheckpoint`` saves."""
        raise NotImplementedError(f"{type(self).__name__} must define write_file(trainer, filepath).")

    def remove_file(self, trainer: pl.Trainer, filepath: str) -> None:
        """Remove `filepath`, a file that top-k or ``last`` replaced (default: through the strategy)."""
        trainer.strategy.remove_checkpoint(filepath)

    def resumable(self, trainer: pl.Trainer, last_files: set[str]) -> set[str]:
        """Which of this callback's ``last`` files ``Trainer.fit(ckpt_path="last")`` may load (default: all)."""
        return last_files

    def with_progress(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> dict[str, Tensor]:
        """The metrics that name and rank a file, ``epoch`` and ``step`` included (default: as they are)."""
        return candidates

    def before_top_k(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        """Called before each top-k decision with the metrics it ranks by (default: nothing)."""

    # ----------------------------------------------------------------------------- public readers
    def candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        """The metrics a save at this point names and ranks its file by (after `with_progress`)."""
        return self._monitor_candidates(trainer)

    def rule_key(self, **extra: Any) -> str:
        """A `state_key` made of `extra`, then ``ModelCheckpoint``'s own: monitor, mode and trigger."""
        return self._generate_state_key(
            **extra, monitor=self.monitor, mode=self.mode, every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs, train_time_interval=self._train_time_interval,
        )

    # ----------------------------------------------------------------------------- the private methods
    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        # NOTE: ModelCheckpoint's body with `write_file` for `trainer.save_checkpoint`: the two fields
        # tell its hooks that this step is saved (so `last` follows, and no second save) and which file.
        self.write_file(trainer, filepath)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self.remove_file(trainer, filepath)

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        return self.resumable(trainer, super()._find_last_checkpoints(trainer))

    @override
    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        return self.with_progress(trainer, super()._monitor_candidates(trainer))

    @override
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        self.before_top_k(trainer, monitor_candidates)
        super()._save_topk_checkpoint(trainer, monitor_candidates)
