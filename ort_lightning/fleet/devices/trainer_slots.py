"""What a fleet worker shares among the devices it runs: one module and one ``Trainer`` per artifacts and options.

A worker (`LocalGrid`, or one Ray actor) runs many devices one after another. Built from nothing,
a device costs an ORT session and a ``lightning.Trainer``: many times a 1-batch device's training.
So a worker keeps, per artifacts and options, a `Slot` (one module, one Trainer). A device's
round takes an idle slot, loads the server's values and its optimizer state
(`ORTLightningModule.load_values`), fits with fresh loops and hands the slot back: nothing of a
device stays in it. At most `MAX_KINDS` kinds are kept, so that memory does not grow.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from ort_lightning.training.loops import fresh_loops
from ort_lightning.training.module import ORTLightningModule

__all__ = ["MAX_KINDS", "WORKER", "Slot", "SlotKind", "Worker", "fresh_loops"]

#: Kinds of slot (artifacts and options) a worker keeps at most; the least recently used one leaves.
MAX_KINDS = 4


@dataclass(frozen=True)
class SlotKind:
    """What a slot is built from (the resolved folder, the start, the options by ``repr``): equal kinds share slots."""

    artifacts: str
    start: str
    module_options: tuple[tuple[str, str], ...]
    trainer_options: tuple[tuple[str, str], ...]

    @classmethod
    def of(
        cls, artifacts: str | os.PathLike[str], *, start: str, module_options: dict[str, Any],
        trainer_options: dict[str, Any],
    ) -> SlotKind:
        """The kind of a module of `artifacts` started as `start` with these options (see the class)."""
        return cls(os.path.realpath(artifacts), start, _described(module_options), _described(trainer_options))


def _described(options: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, repr(value)) for name, value in options.items()))


@dataclass
class Slot:
    """One module and one Trainer, held by one device at a time."""

    module: ORTLightningModule
    trainer: pl.Trainer

    def fit(self, *args: Any, **kwargs: Any) -> None:
        """``trainer.fit(module, ...)`` with fresh loops: epochs and steps count from 0, as in a new Trainer.

        The Trainer lets go of the fit's optimizer at the end: it holds the ORT session the
        device trained, which the next device's load replaces.
        """
        fresh_loops(self.trainer)
        try:
            self.trainer.fit(self.module, *args, **kwargs)
        finally:
            strategy = self.trainer.strategy
            strategy.optimizers, strategy.lr_scheduler_configs = [], []


class Worker:
    """The idle slots of this process, per kind (at most `MAX_KINDS` kinds)."""

    def __init__(self) -> None:
        self._idle: OrderedDict[SlotKind, list[Slot]] = OrderedDict()
        self._lock = threading.Lock()
        #: Slots built so far (the first device of a kind builds one; every other one reuses it).
        self.built = 0

    @contextlib.contextmanager
    def slot(self, kind: SlotKind, build: Callable[[], Slot]) -> Iterator[Slot]:
        """An idle slot of `kind` (`build` makes one when there is none), handed back when the block ends.

        A slot whose device raised is handed back too: the next device's load replaces all it holds.
        """
        with self._lock:
            idle = self._idle.pop(kind, [])
            taken = idle.pop() if idle else None
            self._idle[kind] = idle
        if taken is None:
            taken = build()
            with self._lock:
                self.built += 1
        try:
            yield taken
        finally:
            self._give_back(kind, taken)

    def _give_back(self, kind: SlotKind, slot: Slot) -> None:
        with self._lock:
            self._idle.setdefault(kind, []).append(slot)
            self._idle.move_to_end(kind)
            while len(self._idle) > MAX_KINDS:
                self._idle.popitem(last=False)

    def clear(self) -> None:
        """Drop every idle slot and count builds from 0 (a slot a device holds now comes back when its round ends)."""
        with self._lock:
            self._idle.clear()
            self.built = 0


#: This process's worker.
WORKER = Worker()

