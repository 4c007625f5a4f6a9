"""What the console script keeps off its output: Lightning's tips and the known warnings of the pinned versions.

The filters apply around one command (`quiet_lightning`), never at import. Each pattern names a
line lightning 2.6 on torch 2.13 prints on every run that asks nothing of the user (accelerator
lines, tips, the stepping-batches estimate, known deprecations); any other line still prints.
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
