"""The ``ort-lightning`` console script.

Subcommands:

- ``demo``: export, train and validate a digits classifier; write artifacts and models.
- ``export``: turn an ONNX file or a ``package.module:factory`` torch model into artifacts.
- ``fit | validate | test | predict --config cfg.yaml``: LightningCLI over `ORTLightningModule`
  and any ``LightningDataModule``.
- ``inspect DIR | CHECKPOINT``: what a set of artifacts or an ORT checkpoint holds.
- ``save-pretrained CHECKPOINT --out FOLDER``: a trained checkpoint (``.ortckpt`` with ``--artifacts``, ``.ckpt``)
  as the folder peft or transformers loads (an adapter folder; ``--merge``: the merged model).
- ``fleet --config fleet.yaml [--set KEY=VALUE ...]``: federated training of a model on its data module's
  partitions, on simulated devices with Flower (needs the ``fleet`` extra); accuracy per round, a checkpoint per
  round. ``--browsers``: the devices are browsers that open the URL it prints (``engine.name: browser``).

Errors print one line, without a traceback, and exit with status 2: the last line on stderr, the only
one that starts with ``ort-lightning: error:``. A line a library prints as it is imported (torch's
"No CUDA runtime is found" on a machine with a CUDA toolkit and no GPU) may come before it.

Example::

    $ ort-lightning demo --out runs/demo --epochs 10
    $ ort-lightning inspect runs/demo/artifacts
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ort_lightning.cli.quiet import quiet_lightning
from ort_lightning.cli.usage import OneLineParser, UsageError
from ort_lightning.errors import ORTLightningError

__all__ = ["ERROR_PREFIX", "main", "output_folder"]

#: How the console script's one error line starts.
ERROR_PREFIX = "ort-lightning: error: "

_LIGHTNING_HELP = {
    "fit": "train with LightningCLI: --config cfg.yaml",
    "validate": "validate a model: --config cfg.yaml --ckpt_path last",
    "test": "test a model: --config cfg.yaml --ckpt_path last",
    "predict": "write predictions.pt: --config cfg.yaml --ckpt_path last",
}
_LIGHTNING_SUBCOMMANDS = tuple(_LIGHTNING_HELP)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; return the process exit status (2 after a one-line error)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _import_from_current_folder()
    handler: Callable[[], Any]
    try:
        if args and args[0] in _LIGHTNING_SUBCOMMANDS:
            handler = lambda: _lightning_cli(args)  # noqa: E731 - one deferred call
        else:
            namespace = _parser().parse_args(args)
            handler = lambda: namespace.handler(namespace)  # noqa: E731
        with quiet_lightning():
            handler()
    except UsageError as error:
        return _print_error(str(error))
    except Exception as error:
        if not isinstance(error, _one_line_errors()):
            raise
        # One line, no traceback: ORT's and Lightning's refusals, and the package's own errors.
        return _print_error(f"{type(error).__name__}: {error}")
    return 0


def _one_line_errors() -> tuple[type[Exception], ...]:
    """The errors printed as one line: Lightning's only where it was imported (``inspect`` does not import it)."""
    errors: tuple[type[Exception], ...] = (ImportError, OSError, ValueError, RuntimeError, ORTLightningError)
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")
    return (*errors, lightning.MisconfigurationException) if lightning else errors


def _print_error(message: str) -> int:
    """Print `message` as the one error line, after anything printed before it; return the exit status, 2."""
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"{ERROR_PREFIX}{' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2


def _import_from_current_folder() -> None:
    """Put the current folder first on the import path, as ``python -m`` does.

    NOTE: a console script's import path starts at its own folder, so ``mypkg.models:make_model``
    (or ``data: mypkg.DataModule`` in a config) would not be found beside the user's code.
    """
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="ort-lightning",
        description="Train ONNX Runtime training artifacts with a Lightning Trainer. "
        "Errors print one line and exit with status 2.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser("demo", help="export, train and validate a digits classifier")
    demo.add_argument("--out", type=Path, default=Path("ort-lightning-demo"), help="output folder")
    demo.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    demo.add_argument("--lr", type=float, default=0.01, help="peak learning rate")
    demo.set_defaults(handler=_demo)

    export = commands.add_parser("export", help="write training artifacts from ONNX or a torch factory")
    export.add_argument("source", help="an .onnx file, or package.module:factory returning a torch.nn.Module")
    export.add_argument("--out", type=Path, required=True, help="artifacts folder")
    export.add_argument("--input-shape", action="append", default=[], metavar="D1,D2,...",
                        help="shape of one model input without the batch dimension, e.g. 3,32,32 (repeat per input)")
    export.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                        help="dtype of one model input (default float32; repeat per input)")
    export.add_argument("--input-name", action="append", default=[], metavar="NAME", help="name of one model input")
    export.add_argument(
        "--loss",
        default="cross_entropy",
        help="cross_entropy | nll | mse | l1 | bce_with_logits | smooth_l1 | huber | none",
    )
    export.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    export.add_argument("--optimizer-option", action="append", default=[], metavar="KEY=VALUE",
                        help="e.g. weight_decay=0.0 or betas=0.9,0.98")
    export.add_argument("--frozen", action="append", default=[], metavar="NAME", help="parameter not to train")
    export.add_argument("--nominal-checkpoint", action="store_true",
                        help="also write nominal_checkpoint (no weights), what devices that receive weights start from")
    export.add_argument("--ort-format", action="store_true", help="also write .ort graphs (mobile builds of ORT)")
    export.add_argument("--report", action="store_true",
                        help="print the whole inspect report of the artifacts, not only the one summary line")
    export.set_defaults(handler=_export)

    inspect = commands.add_parser("inspect", help="describe an artifacts folder or an ORT checkpoint file")
    inspect.add_argument("path", type=Path)
    inspect.set_defaults(handler=_inspect)

    pretrained = commands.add_parser(
        "save-pretrained", help="write a checkpoint as a peft or transformers folder"
    )
    pretrained.add_argument("source", type=Path,
                            help="an ORT checkpoint file (.ortckpt), a Lightning .ckpt, or an artifacts folder")
    pretrained.add_argument("--out", type=Path, required=True, help="the folder save_pretrained writes")
    pretrained.add_argument("--artifacts", type=Path, default=None,
                            help="the artifacts folder the checkpoint was trained on (needed for an .ortckpt)")
    pretrained.add_argument("--merge", action="store_true",
                            help="merge the peft adapters into the base weights and write the merged model")
    pretrained.set_defaults(handler=_save_pretrained)

    fleet = commands.add_parser("fleet", help="federated training on simulated devices or browsers")
    fleet.add_argument("--config", type=Path, required=True,
                       help="YAML of the fleet config's sections (examples/fleet_digits.yaml)")
    fleet.add_argument("--browsers", action="store_true",
                       help="the devices are browsers that open the printed URL (engine.name: browser)")
    fleet.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                       help="override one key, e.g. --set rounds=3 --set devices.lr=0.05 (repeat per key)")
    fleet.set_defaults(handler=_fleet)
    for name, text in _LIGHTNING_HELP.items():
        # NOTE: listed for --help and for the invalid-choice message; main() hands them to LightningCLI.
        commands.add_parser(name, help=text)
    return parser


def output_folder(path: Path, *, writes: str) -> Path:
    """Return `path`, the ``--out`` folder, unless it is an existing file.

    Example::

        >>> str(output_folder(Path("runs/demo"), writes="artifacts/"))
        'runs/demo'

    Raises:
        UsageError: when `path` exists and is not a folder.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--out {str(path)!r} is a file, but --out names the folder that receives {writes}; "
            f"pass a folder that does not exist yet (it is created) or an existing folder, e.g. --out {path}-run"
        )
    return path


# ----------------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from ort_lightning import ORTCheckpoint, ORTLightningModule, export_artifacts
    from ort_lightning.cli.progress import fit_line, progress_callbacks
    from ort_lightning.demo import FEATURES, DigitsDataModule, digits_mlp

    out: Path = output_folder(args.out, writes="artifacts/, checkpoints/, digits.onnx and logs/")
    artifacts = export_artifacts(digits_mlp(), torch.zeros(2, FEATURES), out / "artifacts")
    data = DigitsDataModule(batch_size=64)
    module = ORTLightningModule(artifacts, lr=args.lr, warmup_steps=0.1)
    checkpoints = ORTCheckpoint(out / "checkpoints", inference_model=out / "digits.onnx")
    trainer = pl.Trainer(
        max_epochs=args.epochs, logger=CSVLogger(out, name="logs"),
        default_root_dir=out, enable_model_summary=False, callbacks=[checkpoints, *progress_callbacks()],
    )
    trainer.fit(module, datamodule=data)
    print(fit_line(trainer))
    accuracy = _accuracy(module, data.val_dataloader())
    print(f"validation accuracy: {accuracy:.2%}")
    print(f"artifacts:        {artifacts.directory}")
    print(f"ORT checkpoint:   {checkpoints.last_path}")
    print(f"inference model:  {out / 'digits.onnx'}")


def _accuracy(module: Any, loader: Any) -> float:
    correct = total = 0
    for x, y in loader:
        correct += int((module(x).argmax(dim=1) == y).sum())
        total += len(y)
    return correct / total


# ----------------------------------------------------------------------------- export
def _export(args: argparse.Namespace) -> None:
    from ort_lightning import export_artifacts
    from ort_lightning.cli.describe import describe, summary_line
    from ort_lightning.cli.factory import export_factory, parse_shape

    output_folder(args.out, writes="the artifacts")
    loss = None if args.loss == "none" else args.loss
    options = dict(_option(text) for text in args.optimizer_option)
    common: dict[str, Any] = dict(
        loss=loss, optimizer=args.optimizer, optimizer_options=options or None, frozen=args.frozen,
        nominal_checkpoint=args.nominal_checkpoint, ort_format=args.ort_format,
    )
    if args.source.endswith(".onnx"):
        artifacts = export_artifacts(args.source, None, args.out, **common)
    else:
        shapes = [parse_shape(text) for text in args.input_shape]
        artifacts = export_factory(args.source, shapes, args.out, dtypes=args.input_dtype,
                                   input_names=args.input_name or None, **common)
    print(describe(artifacts.directory) if args.report else summary_line(artifacts.directory))


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    try:
        numbers = [float(part) for part in value.split(",")] if sep else []
    except ValueError:
        numbers = []
    if not numbers:
        raise UsageError(f"bad --optimizer-option {text!r}: expected KEY=NUMBER[,NUMBER], e.g. weight_decay=0.0")
    return key, numbers if len(numbers) > 1 else numbers[0]


# ----------------------------------------------------------------------------- inspect
def _inspect(args: argparse.Namespace) -> None:
    from ort_lightning.cli.describe import describe

    print(describe(args.path))


# ----------------------------------------------------------------------------- save-pretrained
def _save_pretrained(args: argparse.Namespace) -> None:
    from ort_lightning import save_pretrained

    output_folder(args.out, writes="the model's save_pretrained files")
    folder = save_pretrained(args.source, args.out, artifacts=args.artifacts, merge=args.merge)
    print(f"wrote {folder}: {', '.join(sorted(path.name for path in folder.iterdir()))}")


# ----------------------------------------------------------------------------- fleet
def _fleet(args: argparse.Namespace) -> None:
    from ort_lightning.fleet.run import FleetConfig, run_fleet

    config = FleetConfig.from_yaml(args.config, overrides=args.overrides)
    if args.browsers:
        config = config.replace(engine={"name": "browser"})
    # NOTE: a module the config names by import path is found beside the config file first.
    run_fleet(config, search=[args.config.resolve().parent])


# ----------------------------------------------------------------------------- LightningCLI
def _lightning_cli(args: list[str]) -> None:
    from ort_lightning.cli.lightning_cli import run_lightning_cli

    run_lightning_cli(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
