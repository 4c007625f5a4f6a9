"""`ORTCheckpoint`: Lightning's `ModelCheckpoint`, writing ONNX Runtime checkpoint files.

When and which files exist is ``ModelCheckpoint``'s own decision (names, top-k, intervals,
``save_last``); only the file differs: what ORT's ``CheckpointState.load_checkpoint`` reads,
written atomically with a ``.sha256`` sidecar. Lightning's private methods are reached only
through `lightning_private.ModelCheckpointAdapter`.

Example::

    >>> from ort_lightning import ORTCheckpoint
    >>> ORTCheckpoint("checkpoints", monitor="val_loss", save_top_k=2).format_name({"epoch": 3, "step": 120})
    'epoch=3-step=120'
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ort_lightning.errors import ArtifactError, CheckpointError, ConfigurationError
from ort_lightning.pretrained.record import read_record
from ort_lightning.storage.atomic import remove_with_digest
from ort_lightning.storage.temps import check_writable, remove_stale_temps
from ort_lightning.training.checkpointing.checkpoint_files import Checkpointable
from ort_lightning.training.checkpointing.lightning_private import ModelCheckpointAdapter

__all__ = ["ORTCheckpoint", "pretrained_folder"]

EXTENSION = ".ortckpt"


class ORTCheckpoint(ModelCheckpointAdapter):
    """Save ORT CheckpointState files with `ModelCheckpoint`'s rules; optionally an inference model.

    Only global rank 0 writes. Steps and epochs in names and properties count across resumes.

    Args:
        dirpath: folder of the checkpoint files (None: as ``ModelCheckpoint``).
        filename: name template without extension, as ``ModelCheckpoint``'s (``{epoch}-{val_loss:.3f}``).
        every_n_train_steps: save after every N optimizer steps.
        every_n_epochs: save every N epochs; None means 1 unless another interval is given.
        save_last: also write ``last.ortckpt`` at each save: the file to resume from.
        monitor: logged metric that ranks the files; None keeps the latest one.
        mode: ``"min"`` or ``"max"``: which `monitor` value is best.
        save_top_k: files kept besides ``last`` (-1: all, 0: none).
        include_optimizer_state: store the optimizer's step and moments (needed to resume exactly).
        inference_model: write a plain ONNX inference model there when ``fit`` ends.
        pretrained: beside each ``<name>.ortckpt``, write ``<name>-pretrained``, the folder transformers
            or peft loads (``ort_lightning.save_pretrained``).
        verbose: log each save.
        auto_insert_metric_name: ``{val_loss}`` becomes ``val_loss=0.12`` (False: ``0.12``).
        train_time_interval: save at this wall-clock interval instead.
        save_on_train_epoch_end: as ``ModelCheckpoint``.
        enable_version_counter: add ``-v1``, ``-v2`` to a name that exists already.

    Raises:
        ConfigurationError: for an option out of range or a combination ``ModelCheckpoint`` refuses.
    """

    FILE_EXTENSION = EXTENSION

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        filename: str | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_last: bool = True,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        include_optimizer_state: bool = True,
        inference_model: str | os.PathLike[str] | None = None,
        pretrained: bool = False,
        verbose: bool = False,
        auto_insert_metric_name: bool = True,
        train_time_interval: timedelta | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
    ) -> None:
        _check_options(every_n_train_steps, every_n_epochs, mode, save_top_k, monitor, save_last)
        try:
            super().__init__(
                dirpath=None if dirpath is None else os.fspath(dirpath), filename=filename, monitor=monitor,
                verbose=verbose, save_last=save_last, save_top_k=save_top_k, mode=mode,
                auto_insert_metric_name=auto_insert_metric_name, every_n_train_steps=every_n_train_steps,
                train_time_interval=train_time_interval, every_n_epochs=every_n_epochs,
                save_on_train_epoch_end=save_on_train_epoch_end, enable_version_counter=enable_version_counter,
            )
        except MisconfigurationException as error:
            raise ConfigurationError(f"{str(error).rstrip('.')}; pass only one of every_n_train_steps, "
                                     "every_n_epochs and train_time_interval.") from error
        self.include_optimizer_state = include_optimizer_state
        self.inference_model = None if inference_model is None else Path(inference_model)
        self.pretrained = pretrained

    @property
    @override
    def state_key(self) -> str:
        """Separate state per folder and per rule, so that two instances resume their own."""
        return self.rule_key(dirpath=None if self.dirpath is None else os.fspath(self.dirpath), filename=self.filename)

    # ----------------------------------------------------------------------------- public helpers
    @property
    def best_path(self) -> Path | None:
        """`best_model_path` as a `Path` (None before the first save)."""
        return Path(self.best_model_path) if self.best_model_path else None

    @property
    def last_path(self) -> Path | None:
        """`last_model_path` as a `Path`: the file to resume from (None before the first save)."""
        return Path(self.last_model_path) if self.last_model_path else None

    def format_name(self, metrics: dict[str, Any]) -> str:
        """The file name, without folder and extension, that `metrics` give (``ModelCheckpoint``'s rules)."""
        values = {name: value if isinstance(value, torch.Tensor) else torch.tensor(value)
                  for name, value in metrics.items()}
        name = os.path.basename(self.format_checkpoint_name(values))
        return name[: -len(self.FILE_EXTENSION)]

    # ----------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a module or a folder that cannot take ORT checkpoints; clear temp files of an interrupted write.

        Raises:
            ConfigurationError: for a module other than `ORTLightningModule`, or ``pretrained=True`` on
                artifacts that record no transformers model.
            CheckpointError: for a `dirpath` that cannot be created or written.
        """
        if not isinstance(pl_module, Checkpointable):
            raise ConfigurationError(
                f"ORTCheckpoint saves ONNX Runtime state, but the module is a {type(pl_module).__name__}; use it "
                "with ORTLightningModule, or use lightning's ModelCheckpoint for torch modules."
            )
        if self.pretrained:
            _check_record(pl_module)
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and stage == "fit" and not _fast_dev_run(trainer):
            folder = Path(os.fspath(self.dirpath or "."))
            check_writable(folder)
            remove_stale_temps(folder)
        if stage == "fit":
            _continue_last(self, pl_module)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``ckpt_path=`` resume's state, and go on replacing its ``last`` file.

        NOTE: Lightning saves the ``.ckpt`` before this callback saves the same step; without adopting
        ``last``, the version counter would write ``last-v1`` and leave ``last`` stale.
        """
        super().load_state_dict(state_dict)
        if state_dict.get("dirpath", self.dirpath) == self.dirpath:
            _adopt_last(self)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write ``last`` if no save happened yet, except where ``ModelCheckpoint`` writes nothing."""
        # NOTE: ModelCheckpoint's own on_train_end writes `last` even under fast_dev_run, where its
        # `_should_skip_saving_checkpoint` (the rule everywhere else) writes nothing.
        if not _fast_dev_run(trainer):
            super().on_train_end(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Export the inference model when `inference_model` is set."""
        if self.inference_model is None or _fast_dev_run(trainer):
            return
        if trainer.is_global_zero:
            _module(pl_module).export_inference_model(self.inference_model)
        trainer.strategy.barrier("ORTCheckpoint.inference_model")

    # ----------------------------------------------------------------------------- ModelCheckpoint's file access
    @override
    def write_file(self, trainer: pl.Trainer, filepath: str) -> None:
        """Write the ORT checkpoint `filepath` on global rank 0 (atomically, with its digest); the others wait."""
        module = _module(trainer.lightning_module)
        if trainer.is_global_zero:
            module.save_ort_checkpoint(
                filepath, include_optimizer_state=self.include_optimizer_state, properties=_properties(self, trainer)
            )
            if self.pretrained:
                module.save_pretrained(pretrained_folder(filepath))
        trainer.strategy.barrier("ORTCheckpoint.save")

    @override
    def remove_file(self, trainer: pl.Trainer, filepath: str) -> None:
        """Remove a replaced file with its ``.sha256`` digest (and its ``-pretrained`` folder)."""
        if trainer.is_global_zero:
            remove_with_digest(Path(filepath))
            shutil.rmtree(pretrained_folder(filepath), ignore_errors=True)

    @override
    def resumable(self, trainer: pl.Trainer, last_files: set[str]) -> set[str]:
        """None: ``Trainer.fit(ckpt_path="last")`` must never take an ORT file for a Lightning ``.ckpt``.

        Raises:
            CheckpointError: when this callback's ``last`` file is the only one a ``"last"`` resume could use.
        """
        others = [cb for cb in trainer.checkpoint_callbacks if not isinstance(cb, ORTCheckpoint)]
        if last_files and not others:
            last = sorted(last_files)[-1]
            raise CheckpointError(
                f"Trainer.fit(ckpt_path='last') found only {last}, an ORT checkpoint, which Lightning cannot load "
                "as a .ckpt; resume from it with ORTLightningModule(artifacts, checkpoint="
                f"{last!r}) and fit without ckpt_path, or add lightning's ModelCheckpoint(save_last=True) to the "
                "callbacks so that 'last' finds a Lightning .ckpt."
            )
        return set()

    @override
    def with_progress(self, trainer: pl.Trainer, candidates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``epoch`` and ``step`` counted across resumes from ``ORTLightningModule(..., checkpoint=...)``."""
        start = _module(trainer.lightning_module).start_progress
        candidates["epoch"] = candidates["epoch"] + start["epoch"]
        candidates["step"] = candidates["step"] + start["global_step"]
        return candidates

    @override
    def before_top_k(self, trainer: pl.Trainer, candidates: dict[str, torch.Tensor]) -> None:
        """Refuse a `monitor` that was never logged (ModelCheckpoint only warns, then saves nothing).

        Raises:
            CheckpointError: when `monitor` is not among the logged metrics.
        """
        if self.save_top_k != 0 and self.monitor is not None and self.monitor not in candidates:
            raise CheckpointError(
                f"ORTCheckpoint(monitor={self.monitor!r}) found no such logged metric (logged: "
                f"{sorted(k for k in candidates if k not in ('epoch', 'step'))}); log it with self.log, "
                "or save after validation (every_n_epochs) so that validation metrics exist when it saves."
            )


def pretrained_folder(filepath: str | os.PathLike[str]) -> Path:
    """The ``save_pretrained`` folder beside checkpoint file `filepath` (``<name>-pretrained``)."""
    path = Path(filepath)
    return path.with_name(f"{path.stem}-pretrained")


def _check_record(pl_module: pl.LightningModule) -> None:
    """Refuse ``pretrained=True`` before the first step when the artifacts record no transformers model."""
    folder = _module(pl_module).artifacts.directory
    try:
        read_record(folder)
    except ArtifactError as error:
        raise ConfigurationError(
            f"ORTCheckpoint(pretrained=True) writes the folder transformers or peft loads beside each checkpoint, but "
            f"{folder} records no transformers model to rebuild ({error}); export a transformers PreTrainedModel or a "
            "peft PeftModel over one, or leave pretrained= out."
        ) from error


def _continue_last(callback: ORTCheckpoint, pl_module: pl.LightningModule) -> None:
    """A run resumed with ``checkpoint=`` replaces the folder's ``last`` file instead of adding ``last-v1``."""
    if _module(pl_module).start_progress["global_step"] != 0:
        _adopt_last(callback)


def _adopt_last(callback: ORTCheckpoint) -> None:
    """Take the folder's ``last`` file as `callback`'s own, when it knows no other."""
    if callback.last_model_path or not callback.save_last:
        return
    last = callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)
    if os.path.isfile(last):
        callback.last_model_path = last


def _properties(callback: ORTCheckpoint, trainer: pl.Trainer) -> dict[str, int | float | str]:
    candidates = callback.candidates(trainer)
    properties: dict[str, int | float | str] = {
        "epoch": int(candidates["epoch"]), "global_step": int(candidates["step"])
    }
    if callback.monitor is not None and callback.monitor in candidates:
        properties["monitor"] = callback.monitor
        properties["monitor_value"] = float(candidates[callback.monitor])
    return properties


def _fast_dev_run(trainer: pl.Trainer) -> bool:
    # NOTE: the Trainer sets `fast_dev_run` in its connectors, so type checkers do not see it.
    return bool(getattr(trainer, "fast_dev_run", False))


def _module(pl_module: pl.LightningModule) -> Checkpointable:
    assert isinstance(pl_module, Checkpointable)  # checked in setup
    return pl_module


def _check_options(
    every_n_train_steps: int | None, every_n_epochs: int | None, mode: str, save_top_k: int, monitor: str | None,
    save_last: object = True,
) -> None:
    if not isinstance(save_last, bool):
        # NOTE: Lightning's save_last="link" links the .ortckpt but not the sha256 file beside it.
        raise ConfigurationError(
            f"Expected argument `save_last` to be True or False, but got {save_last!r}; ORTCheckpoint writes "
            "last.ortckpt as a file of its own (with its digest), so pass save_last=True."
        )
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ConfigurationError(f"Expected argument `{name}` to be an int >= 0 or None, but got {value!r}.")
    if mode not in ("min", "max"):
        raise ConfigurationError(f"Expected argument `mode` to be 'min' or 'max', but got {mode!r}.")
    if not isinstance(save_top_k, int) or save_top_k < -1:
        raise ConfigurationError(
            f"Expected argument `save_top_k` to be an int >= -1 (-1 keeps all files), but got {save_top_k!r}."
        )
    if monitor is None and save_top_k > 1:
        raise ConfigurationError(
            f"ORTCheckpoint(save_top_k={save_top_k}, monitor=None) has nothing to rank files by; pass a `monitor` "
            "(monitor='step', mode='max' keeps the most recent files) or save_top_k in (-1, 0, 1)."
        )
