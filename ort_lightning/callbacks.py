"""`ORTCheckpoint`: ONNX Runtime checkpoint files during training, an inference model at the end.

Each file is what ``onnxruntime.training.api.CheckpointState.load_checkpoint`` reads, written
atomically with a ``.sha256`` sidecar, and carries the properties ``epoch``, ``global_step``,
``lr``, ``ort_lightning_version`` and, with `monitor`, ``monitor`` and ``monitor_value``.
Steps and epochs count across resumes from ``ORTLightningModule(..., checkpoint=...)``.

Example::

    >>> from ort_lightning import ORTCheckpoint
    >>> callback = ORTCheckpoint("checkpoints", monitor="val_loss", save_top_k=2)
    >>> callback.format_name({"epoch": 3, "step": 120})
    'epoch=3-step=120'
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from ort_lightning._atomic import check_writable, remove_stale_temps, remove_with_digest
from ort_lightning._checkpointing import CheckpointingMixin
from ort_lightning.errors import CheckpointError, ConfigurationError

__all__ = ["ORTCheckpoint"]

EXTENSION = ".ortckpt"
_FIELD = re.compile(r"\{([^{}:]+)(?::[^{}]*)?\}")


class ORTCheckpoint(Callback):
    """Save ORT CheckpointState files every N steps or epochs, keep the best k and the last.

    Only global rank 0 writes; the other ranks wait at the strategy's barrier.

    Args:
        dirpath: folder of the checkpoint files.
        filename: name template without extension; ``{epoch}``, ``{step}`` and logged metrics
            (``{val_loss:.3f}``) become ``epoch=3``, ``step=120``, ``val_loss=0.123``.
        every_n_train_steps: save after every N optimizer steps (None: never by steps).
        every_n_epochs: save at the end of every N training epochs (None or 0: never by epochs);
            that epoch's validation metrics are already logged then.
        save_last: also write ``last.ortckpt`` at each save: the file to resume from.
        monitor: logged metric that ranks the files; None keeps the most recent ones.
        mode: ``"min"`` or ``"max"``: which `monitor` value is best.
        save_top_k: files kept besides ``last`` (-1: all, 0: none); the others are deleted.
        include_optimizer_state: store the optimizer's step and moments (needed to resume exactly).
        inference_model: write a plain ONNX inference model there when ``fit`` ends.

    Raises:
        ConfigurationError: for an option out of range.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        filename: str = "{epoch}-{step}",
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = 1,
        save_last: bool = True,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        include_optimizer_state: bool = True,
        inference_model: str | os.PathLike[str] | None = None,
    ) -> None:
        _check_options(every_n_train_steps, every_n_epochs, mode, save_top_k)
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs
        self.save_last = save_last
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.include_optimizer_state = include_optimizer_state
        self.inference_model = None if inference_model is None else Path(inference_model)
        self.kept: dict[str, float] = {}
        self.last_path: Path | None = None
        self._saves = 0
        self._last_saved_step = -1

    # ----------------------------------------------------------------------------- public helpers
    @property
    def best_path(self) -> Path | None:
        """The kept file with the best score (the most recent one without `monitor`)."""
        if not self.kept:
            return None
        return Path(min(self.kept, key=lambda path: self._rank(self.kept[path])))

    def format_name(self, metrics: dict[str, Any]) -> str:
        """Fill the filename template: ``{name}`` becomes ``name=value``.

        Raises:
            CheckpointError: for a template field that is neither epoch, step nor a logged metric.
        """
        template = self.filename
        for name in dict.fromkeys(_FIELD.findall(template)):
            if name not in metrics:
                raise CheckpointError(
                    f"Filename template {self.filename!r} names {name!r}, but only {sorted(metrics)} are known; "
                    "log that metric or change `filename`."
                )
            template = template.replace("{" + name, name + "={" + name)
        values = {name: float(v) if hasattr(v, "item") else v for name, v in metrics.items()}
        return template.format_map(values)

    # ----------------------------------------------------------------------------- hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module or a folder that cannot take ORT checkpoints; clear temp files of an interrupted write.

        Raises:
            ConfigurationError: for a module other than `ORTLightningModule`.
            CheckpointError: for a `dirpath` that cannot be created or written (found before any step).
        """
        if not isinstance(pl_module, CheckpointingMixin):
            raise ConfigurationError(
                f"ORTCheckpoint saves ONNX Runtime state, but the module is a {type(pl_module).__name__}; use it "
                "with ORTLightningModule, or use lightning's ModelCheckpoint for torch modules."
            )
        if trainer.is_global_zero:
            check_writable(self.dirpath)
            remove_stale_temps(self.dirpath)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Save every `every_n_train_steps` optimizer steps."""
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and trainer.global_step > 0:
            self._save(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save every `every_n_epochs` epochs."""
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0:
            self._save(trainer, pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Export the inference model when `inference_model` is set."""
        if self.inference_model is None:
            return
        if trainer.is_global_zero:
            _module(pl_module).export_inference_model(self.inference_model)
        trainer.strategy.barrier("ORTCheckpoint.inference_model")

    def state_dict(self) -> dict[str, Any]:
        """The kept files and their scores, so that top-k continues across a resume."""
        return {"kept": dict(self.kept), "last_path": None if self.last_path is None else str(self.last_path),
                "saves": self._saves}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.kept = {str(k): float(v) for k, v in state_dict.get("kept", {}).items()}
        last = state_dict.get("last_path")
        self.last_path = None if last is None else Path(last)
        self._saves = int(state_dict.get("saves", 0))

    # ----------------------------------------------------------------------------- saving
    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self._last_saved_step or trainer.sanity_checking:
            return
        self._last_saved_step = trainer.global_step
        module = _module(pl_module)
        metrics, properties = self._progress(trainer, module)
        if trainer.is_global_zero:
            self._write(module, metrics, properties)
        trainer.strategy.barrier("ORTCheckpoint.save")

    def _progress(self, trainer: pl.Trainer, module: CheckpointingMixin) -> tuple[dict[str, Any], dict[str, Any]]:
        start = module.start_progress
        epoch = start["epoch"] + trainer.current_epoch
        step = start["global_step"] + trainer.global_step
        metrics: dict[str, Any] = {**trainer.callback_metrics, "epoch": epoch, "step": step}
        properties: dict[str, int | float | str] = {"epoch": epoch, "global_step": step}
        if self.monitor is not None:
            properties["monitor"] = self.monitor
            properties["monitor_value"] = self._monitored(metrics)
        return metrics, properties

    def _monitored(self, metrics: dict[str, Any]) -> float:
        if self.monitor not in metrics:
            raise CheckpointError(
                f"ORTCheckpoint(monitor={self.monitor!r}) found no such logged metric (logged: "
                f"{sorted(k for k in metrics if k not in ('epoch', 'step'))}); log it with self.log, or save by "
                "epoch (every_n_epochs) so that validation metrics exist when it saves."
            )
        return float(metrics[self.monitor])

    def _write(self, module: CheckpointingMixin, metrics: dict[str, Any], properties: dict[str, Any]) -> None:
        self._saves += 1
        score = float(properties.get("monitor_value", self._saves))
        if self.save_top_k != 0 and self._qualifies(score):
            path = self.dirpath / (self.format_name(metrics) + EXTENSION)
            module.save_ort_checkpoint(
                path, include_optimizer_state=self.include_optimizer_state, properties=properties
            )
            self.kept[str(path)] = score
            self._prune()
        if self.save_last:
            self.last_path = self.dirpath / ("last" + EXTENSION)
            module.save_ort_checkpoint(
                self.last_path, include_optimizer_state=self.include_optimizer_state, properties=properties
            )

    def _rank(self, score: float) -> float:
        # Lower is better after this mapping: min mode as is, max mode negated, recency first.
        if self.monitor is None:
            return -score
        if math.isnan(score):
            return math.inf
        return score if self.mode == "min" else -score

    def _qualifies(self, score: float) -> bool:
        if self.save_top_k < 0 or len(self.kept) < self.save_top_k:
            return True
        worst = max(self._rank(value) for value in self.kept.values())
        return self._rank(score) < worst

    def _prune(self) -> None:
        if self.save_top_k < 0:
            return
        ordered = sorted(self.kept, key=lambda path: self._rank(self.kept[path]))
        for path in ordered[self.save_top_k:]:
            del self.kept[path]
            remove_with_digest(Path(path))


def _module(pl_module: pl.LightningModule) -> CheckpointingMixin:
    assert isinstance(pl_module, CheckpointingMixin)  # checked in setup
    return pl_module


def _check_options(every_n_train_steps: int | None, every_n_epochs: int | None, mode: str, save_top_k: int) -> None:
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ConfigurationError(f"Expected argument `{name}` to be an int >= 0 or None, but got {value!r}.")
    if mode not in ("min", "max"):
        raise ConfigurationError(f"Expected argument `mode` to be 'min' or 'max', but got {mode!r}.")
    if not isinstance(save_top_k, int) or save_top_k < -1:
        raise ConfigurationError(
            f"Expected argument `save_top_k` to be an int >= -1 (-1 keeps all files), but got {save_top_k!r}."
        )
