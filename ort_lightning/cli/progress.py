"""What the console script says about a fit: one line per epoch outside a terminal, and one line at the end.

Written to a file or a pipe, Lightning's bar keeps every redraw; `EpochLines` prints one line per
epoch there instead, and `fit_line` sums up the fit.

Example::

    >>> format_metrics({"val_loss": 0.10683, "train_loss_step": 0.2, "train_loss_epoch": 0.09, "val_acc": 0.9722})
    'train_loss 0.09, val_acc 0.9722, val_loss 0.1068'
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from typing_extensions import override

__all__ = ["EpochLines", "fit_line", "format_metrics", "progress_callbacks"]


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """``name value`` pairs of the scalar `metrics` at 4 significant digits; step/epoch twins show once."""
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            continue
        if name.endswith("_step") and f"{name[:-5]}_epoch" in metrics:
            continue
        values[name[:-6] if name.endswith("_epoch") else name] = float(value)
    return ", ".join(f"{name} {value:.4g}" for name, value in sorted(values.items()))


class EpochLines(ProgressBar):
    """A progress "bar" for output that is not a terminal: ``epoch 3/10: train_loss 0.2345, val_loss 0.2011``."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True

    @override
    def disable(self) -> None:
        """Print nothing (Lightning disables the bar on ranks other than 0)."""
        self._enabled = False

    @override
    def enable(self) -> None:
        """Print the epoch lines again."""
        self._enabled = True

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the epoch's line (validation at the epoch's end has run by now)."""
        if not self._enabled or trainer.sanity_checking:
            return
        of = f"/{trainer.max_epochs}" if trainer.max_epochs is not None and trainer.max_epochs > 0 else ""
        metrics = format_metrics(trainer.callback_metrics)
        print(f"epoch {trainer.current_epoch + 1}{of}: {metrics or 'no metrics logged'}", flush=True)


def progress_callbacks(options: Mapping[str, Any] | None = None) -> list[ProgressBar]:
    """``[EpochLines()]`` where Lightning's bar would redraw into a file or a pipe, unless the user chose a bar."""
    options = options or {}
    callbacks = options.get("callbacks") or []
    chosen = any(isinstance(callback, ProgressBar) for callback in
                 (callbacks if isinstance(callbacks, list) else [callbacks]))
    if sys.stdout.isatty() or options.get("enable_progress_bar") is False or chosen:
        return []
    return [EpochLines()]


def fit_line(trainer: pl.Trainer) -> str:
    """One line on a finished fit: epochs and steps, the final metrics, the best and last checkpoints, the logs."""
    epochs, steps = trainer.current_epoch, trainer.global_step
    parts = [f"fit: {epochs} epoch{'s' * (epochs != 1)}, {steps} step{'s' * (steps != 1)}"]
    metrics = format_metrics(trainer.callback_metrics)
    if metrics:
        parts.append(metrics)
    parts += _checkpoint_parts(trainer)
    if trainer.logger is not None and trainer.log_dir:
        parts.append(f"logs {trainer.log_dir}")
    return "; ".join(parts)


def _shown(path: str) -> str:
    """`path` from the current folder when it lies inside it (Lightning makes checkpoint paths absolute)."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _checkpoint_parts(trainer: pl.Trainer) -> list[str]:
    """``best PATH`` (a callback with a monitor) and ``last PATH`` of the first checkpoint callback that wrote one."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        parts = []
        if callback.monitor is not None and callback.best_model_path:
            best = f"best {_shown(callback.best_model_path)}"
            score = callback.best_model_score
            parts.append(f"{best} ({callback.monitor} {float(score):.4g})" if score is not None else best)
        last = callback.last_model_path or callback.best_model_path
        if last:
            parts.append(f"last {_shown(last)}")
        if parts:
            return [", ".join(parts)]
    return []
