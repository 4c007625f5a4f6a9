"""What the console script keeps off its output: Lightning's tips and the known warnings of the pinned versions.

The filters apply around one command of the console script (`quiet_lightning`), never at the
package's import: a program that imports ``ort_lightning`` sees every warning its libraries give.
Each pattern names one line that lightning 2.6 on torch 2.13 prints on every run and that asks
nothing of the user:

- the accelerator lines (``GPU available: False, used: False``, TPU, HPU);
- the tips (``💡 Tip: ... litlogger``, ``litmodels``);
- ``Loading `train_dataloader` to estimate number of stepping batches.`` and
  ```Trainer.fit` stopped: `max_epochs=10` reached.`` (the command's own last line says so);
- ``isinstance(treespec, LeafSpec)`` is deprecated (Lightning's ``_pytree`` on torch 2.13);
- the logging interval (``The number of training batches (23) is smaller than the logging
  interval``): a short epoch of an example, logged once per epoch anyway;
- ``Seed set to 0`` (the config's ``seed_everything``, echoed);
- jsonargparse's deprecations of the calls LightningCLI makes (``instantiate_classes``,
  ``add_instantiator``, ``skip_none``): nothing a config can change.

Any other line of Lightning's, a warning about the user's own code or data among them, still prints.

Example::

    >>> import logging
    >>> with quiet_lightning():
    ...     logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator

__all__ = ["KNOWN_LINES", "KNOWN_WARNINGS", "quiet_lightning"]

#: Lightning's informational lines that the console script does not print (regular expressions, matched at the start).
KNOWN_LINES = (
    r"(GPU|TPU|HPU) available: ",
    r"💡 Tip: ",
    r"Loading `train_dataloader` to estimate number of stepping batches",
    r"`Trainer\.(fit|validate|test|predict)` stopped: ",
    r"Seed set to ",
)
#: Warnings of the pinned versions that the console script does not print (regular expressions of the message).
KNOWN_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)` is deprecated",
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    # LightningCLI's own calls of jsonargparse 4.4x-4.5x API that jsonargparse deprecates
    r"(?s)\s*(By default only one JsonargparseDeprecationWarning|.*\bwas deprecated in v4\.\d+\.\d+)",
)
#: The loggers Lightning's ``rank_zero_info`` (and ``seed_everything``) write through.
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
            "lightning.fabric.utilities.seed")


class _KnownLines(logging.Filter):
    """Drops the records whose message is one of `KNOWN_LINES`."""

    def __init__(self) -> None:
        super().__init__()
        self._known = re.compile("|".join(f"(?:{pattern})" for pattern in KNOWN_LINES))

    def filter(self, record: logging.LogRecord) -> bool:
        return self._known.match(record.getMessage()) is None


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Within the block, Lightning's known tips, notices and deprecation warnings do not print; nothing else changes."""
    known = _KnownLines()
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for logger in loggers:
        logger.addFilter(known)
    try:
        with warnings.catch_warnings():
            for pattern in KNOWN_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(known)
