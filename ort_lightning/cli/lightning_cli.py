"""The console script's LightningCLI subcommands: ``fit | validate | test | predict --config cfg.yaml``.

On top of Lightning's CLI:

- an ``export:`` section names the model factory and input shapes; the artifacts are exported
  to ``model.artifacts`` when that folder does not exist yet, so a config trains as written;
- ``validate``, ``test`` and ``predict`` log nothing (their metrics print as a table), so that
  evaluation runs do not pile up as ``lightning_logs/version_N``; ``predict`` writes its
  outputs to ``<default_root_dir>/predictions.pt`` and says so;
- every mistake in the config or on the command line is one `UsageError` line, checked before
  any process starts: a misspelled key or value (with the closest valid one), a missing config
  file, a precision other than ``32-true``, a parallel strategy other than ``ort_ddp``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from ort_lightning.cli.factory import export_factory
from ort_lightning.cli.progress import fit_line, progress_callbacks
from ort_lightning.cli.usage import UsageError, did_you_mean, one_line_argument_error
from ort_lightning.strategies import check_strategy, trains_ort_graphs
from ort_lightning.training.guards import precision_supported
from ort_lightning.training.module import ORTLightningModule

__all__ = ["ExportSection", "PredictionWriter", "run_lightning_cli"]

_ORT_STRATEGIES = ("auto", "ort_ddp", "ort_ddp_spawn")
_ORT_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


@dataclass
class ExportSection:
    """The ``export:`` section of a config: what to export when ``model.artifacts`` does not exist.

    Args:
        factory: ``package.module:factory`` returning a fresh ``torch.nn.Module``.
        input_shape: one input's shape without the batch dimension (``[64]``, ``[1, 12, 12]``), or
            one such list per model input.
        input_dtype: one torch dtype name per model input (default float32).
        loss: ``cross_entropy``, ``mse``, ``bce_with_logits``, ``l1``, or None when the model returns its loss.
        optimizer: ``adamw`` or ``sgd``.
        optimizer_options: e.g. ``{weight_decay: 0.0}``.
    """

    factory: str | None = None
    input_shape: list[int] | list[list[int]] | None = None
    input_dtype: list[str] | None = None
    loss: str | None = "cross_entropy"
    optimizer: str = "adamw"
    optimizer_options: dict[str, float | list[float]] | None = None


class PredictionWriter(BasePredictionWriter):
    """Write ``predict``'s outputs, concatenated over batches, to one ``torch.save`` file and say where.

    Args:
        path: the file to write (``torch.load(path)`` reads a tensor, or a tuple of tensors for a
            model with several outputs).
    """

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="epoch")
        self.path = path

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Any
    ) -> None:
        """Concatenate the batches' outputs and save them (rank 0 only)."""
        if not trainer.is_global_zero or not predictions:
            return
        first = predictions[0]
        rows: Any = (
            torch.cat(list(predictions)) if isinstance(first, torch.Tensor)
            else tuple(torch.cat([batch[i] for batch in predictions]) for i in range(len(first)))
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rows, self.path)
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else [tuple(r.shape) for r in rows]
        print(f"predictions: {shape} written to {self.path} (read them with torch.load)")


class _ORTLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_class_arguments(ExportSection, "export", fail_untyped=False)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            subcommand = args[0] if args else "fit"
            sub = self._subcommand_parsers.get(subcommand, parser)
            keys = [action.dest for action in sub._actions if action.dest not in ("help", "config")]
            raise UsageError(f"{subcommand}: {one_line_argument_error(str(error), keys)}") from None
        config = self.config[self.config.subcommand]
        _check_precision(config.trainer.precision)
        _check_strategy_name(config.trainer.strategy)
        _check_accelerator(config.trainer.accelerator)
        if self.config.subcommand != "fit":
            _check_ckpt_path(config.get("ckpt_path"), config.trainer.callbacks)
        _ensure_artifacts(config)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        config = self._get(self.config_init, "trainer", default={})
        if self.subcommand != "fit":
            # NOTE: evaluation prints its metrics; a logger would add a lightning_logs/version_N per run.
            if config.get("logger") in (None, True):
                kwargs["logger"] = False
            self.save_config_callback = None
        if config.get("enable_model_summary") is None:
            # NOTE: quiet by default: Lightning's summary table (17 lines for the digits MLP) only on request.
            kwargs["enable_model_summary"] = False
        configured = config.get("callbacks") or []
        callbacks = [*(configured if isinstance(configured, list) else [configured]), *progress_callbacks(config)]
        if self.subcommand == "predict":
            callbacks.append(PredictionWriter(Path(config.get("default_root_dir") or ".") / "predictions.pt"))
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        check_strategy(trainer.strategy)  # a strategy given as a class, before any process starts
        return trainer

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(fit_line(self.trainer))


def _check_precision(precision: Any) -> None:
    if not precision_supported(precision):
        raise UsageError(
            f"--trainer.precision {precision!r} is not supported: ONNX Runtime training graphs run in float32; "
            "use --trainer.precision 32-true (the only supported value) or leave it unset"
        )


def _check_accelerator(accelerator: Any) -> None:
    if not isinstance(accelerator, str):
        return
    if accelerator not in _ORT_ACCELERATORS:
        raise UsageError(
            f"--trainer.accelerator {accelerator!r} cannot run ORT graphs{did_you_mean(accelerator, _ORT_ACCELERATORS)}"
            f" Valid values: {', '.join(_ORT_ACCELERATORS)}"
        )
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UsageError(
            f"--trainer.accelerator {accelerator!r}, but torch sees no CUDA device (torch {torch.__version__}); "
            "use --trainer.accelerator cpu, or install a CUDA build of torch and ort-lightning[cuda]"
        )


def _check_strategy_name(strategy: Any) -> None:
    if not isinstance(strategy, str) or strategy in _ORT_STRATEGIES:
        return
    if strategy not in StrategyRegistry:
        raise UsageError(
            f"unknown --trainer.strategy {strategy!r}{did_you_mean(strategy, _ORT_STRATEGIES) or '.'} "
            f"Valid values for ORT graphs: {', '.join(_ORT_STRATEGIES)}"
        )
    if not trains_ort_graphs(StrategyRegistry[strategy]["strategy"]):
        raise UsageError(
            f"--trainer.strategy {strategy!r} cannot train ORT graphs: its wrapper hooks torch's autograd, which never "
            "sees the gradients ONNX Runtime computes; use --trainer.strategy ort_ddp (or ort_ddp_spawn), "
            "or auto for one process"
        )


def _checkpoint_folders(callbacks: Any) -> list[Path]:
    folders = []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks] if callbacks else []:
        init_args = getattr(callback, "init_args", None)
        dirpath = getattr(init_args, "dirpath", None) if init_args is not None else None
        if "ModelCheckpoint" in str(getattr(callback, "class_path", "")) and dirpath:
            folders.append(Path(dirpath))
    return folders


def _check_ckpt_path(ckpt_path: Any, callbacks: Any) -> None:
    if ckpt_path is None or ckpt_path == "best" or Path(str(ckpt_path)).is_file():
        return
    if ckpt_path != "last":
        raise UsageError(
            f"--ckpt_path {str(ckpt_path)!r} is not a file{did_you_mean(str(ckpt_path), ['last']) or '.'} "
            "Valid values: last, or the path of a .ckpt file"
        )
    folders = _checkpoint_folders(callbacks)
    if not any(next(folder.glob("last*.ckpt"), None) for folder in folders):
        where = ", ".join(str(folder) for folder in folders) or "no ModelCheckpoint with a dirpath in trainer.callbacks"
        raise UsageError(
            f"--ckpt_path last found no last.ckpt ({where}); run fit with this config first, with a ModelCheckpoint "
            "of fixed dirpath and save_last: true in trainer.callbacks (as in examples/digits.yaml)"
        )


def _shapes(value: Any) -> list[list[int]]:
    if not value:
        return []
    return [list(value)] if isinstance(value[0], int) else [list(shape) for shape in value]


def _ensure_artifacts(config: Any) -> None:
    folder = Path(config.model.artifacts)
    if folder.exists():
        return
    export = config.export
    if not export.factory:
        raise UsageError(
            f"model.artifacts folder {str(folder)!r} does not exist; add an export: section to the config "
            "(export.factory: package.module:factory, export.input_shape: [...]) to export it there on first use, "
            f"or run: ort-lightning export FACTORY --input-shape ... --out {folder}"
        )
    artifacts = export_factory(
        export.factory, _shapes(export.input_shape), folder, dtypes=export.input_dtype or (), loss=export.loss,
        optimizer=export.optimizer, optimizer_options=export.optimizer_options,
    )
    print(f"exported {export.factory} to {artifacts.directory} (model.artifacts did not exist yet)")


@contextlib.contextmanager
def _argv(prog: str) -> Iterator[None]:
    # NOTE: LightningCLI(args=...) warns whenever sys.argv holds arguments too; the console script
    # passes its arguments explicitly, so sys.argv shows only the program name meanwhile.
    saved = sys.argv
    sys.argv = [prog]
    try:
        yield
    finally:
        sys.argv = saved


def run_lightning_cli(args: Sequence[str], *, prog: str = "ort-lightning") -> None:
    """Run one LightningCLI subcommand over `ORTLightningModule` and any ``LightningDataModule``.

    Raises:
        UsageError: for a mistake in the config or the arguments, before any training starts.
    """
    with _argv(prog):
        _ORTLightningCLI(
            ORTLightningModule,
            pl.LightningDataModule,
            subclass_mode_data=True,
            # NOTE: the optimizer and schedule come from the ORT artifacts, never from CLI flags.
            auto_configure_optimizers=False,
            save_config_kwargs={"overwrite": True},
            # NOTE: allow_abbrev=False: --trainer.max_epoch must be an unknown key, as in a config file.
            parser_kwargs={"exit_on_error": False, "prog": prog, "allow_abbrev": False},
            args=list(args),
        )
