"""The ``ort-lightning`` console script.

Subcommands:

- ``demo``: export, train and validate a digits classifier; write artifacts and models.
- ``export``: turn an ONNX file or a ``package.module:factory`` torch model into artifacts.
- ``fit | validate | test | predict --config cfg.yaml``: LightningCLI over `ORTLightningModule`
  and any ``LightningDataModule``.
- ``inspect DIR | CHECKPOINT``: what a set of artifacts or an ORT checkpoint holds.

Errors print one line, without a traceback, and exit with status 2.

Example::

    $ ort-lightning demo --out runs/demo --epochs 10
    $ ort-lightning inspect runs/demo/artifacts
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; return the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    handler: Callable[[], Any]
    if args and args[0] in _LIGHTNING_SUBCOMMANDS:
        handler = lambda: _lightning_cli(args)  # noqa: E731 - one deferred call
    else:
        namespace = _parser().parse_args(args)
        handler = lambda: namespace.handler(namespace)  # noqa: E731
    try:
        handler()
    except (ImportError, OSError, ValueError, RuntimeError) as error:
        # ORTLightningError subclasses ValueError/RuntimeError; one line, no traceback.
        message = " ".join(str(error).split())
        print(f"ort-lightning: error: {type(error).__name__}: {message}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ort-lightning",
        description="Train ONNX Runtime training artifacts with a Lightning Trainer. "
        f"Also: {' | '.join(_LIGHTNING_SUBCOMMANDS)} --config cfg.yaml (LightningCLI).",
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
                        help="shape of one model input without the batch dimension (repeat per input)")
    export.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                        help="dtype of one model input (default float32; repeat per input)")
    export.add_argument("--input-name", action="append", default=[], metavar="NAME", help="name of one model input")
    export.add_argument("--loss", default="cross_entropy", help="cross_entropy | mse | bce_with_logits | l1 | none")
    export.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    export.add_argument("--optimizer-option", action="append", default=[], metavar="KEY=VALUE",
                        help="e.g. weight_decay=0.0 or betas=0.9,0.98")
    export.add_argument("--frozen", action="append", default=[], metavar="NAME", help="parameter not to train")
    export.set_defaults(handler=_export)

    inspect = commands.add_parser("inspect", help="describe an artifacts folder or an ORT checkpoint file")
    inspect.add_argument("path", type=Path)
    inspect.set_defaults(handler=_inspect)
    return parser


# ----------------------------------------------------------------------------- demo
def _demo(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from ort_lightning import ORTCheckpoint, ORTLightningModule, export_artifacts
    from ort_lightning.demo import FEATURES, DigitsDataModule, digits_mlp

    out: Path = args.out
    artifacts = export_artifacts(digits_mlp(), torch.zeros(2, FEATURES), out / "artifacts")
    data = DigitsDataModule(batch_size=64)
    module = ORTLightningModule(artifacts, lr=args.lr, warmup_steps=0.1)
    checkpoints = ORTCheckpoint(out / "checkpoints", inference_model=out / "digits.onnx")
    trainer = pl.Trainer(
        max_epochs=args.epochs, logger=CSVLogger(out, name="logs"),
        default_root_dir=out, enable_model_summary=False, callbacks=[checkpoints],
    )
    trainer.fit(module, datamodule=data)
    accuracy = _accuracy(module, data.val_dataloader())
    print(f"validation accuracy: {accuracy:.2%}  (val_loss {trainer.callback_metrics['val_loss'].item():.4f})")
    print(f"artifacts:        {artifacts.directory}")
    print(f"ORT checkpoint:   {checkpoints.last_path}")
    print(f"inference model:  {out / 'digits.onnx'}")
    print(f"logs:             {trainer.logger.log_dir if trainer.logger else out}")


def _accuracy(module: Any, loader: Any) -> float:
    correct = total = 0
    for x, y in loader:
        correct += int((module(x).argmax(dim=1) == y).sum())
        total += len(y)
    return correct / total


# ----------------------------------------------------------------------------- export
def _export(args: argparse.Namespace) -> None:
    import torch

    from ort_lightning import export_artifacts

    loss = None if args.loss == "none" else args.loss
    options = dict(_option(text) for text in args.optimizer_option)
    common: dict[str, Any] = dict(
        loss=loss, optimizer=args.optimizer, optimizer_options=options or None, frozen=args.frozen
    )
    if args.source.endswith(".onnx"):
        artifacts = export_artifacts(args.source, None, args.out, **common)
    else:
        model = _factory(args.source)()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"{args.source} returned {type(model).__name__}, expected a torch.nn.Module.")
        examples = _example_inputs(args.input_shape, args.input_dtype)
        artifacts = export_artifacts(model, examples, args.out, input_names=args.input_name or None, **common)
    print(f"wrote {artifacts.directory}")
    _describe_artifacts(artifacts.directory)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"Expected --optimizer-option KEY=VALUE, but got {text!r}; e.g. weight_decay=0.0.")
    numbers = [float(part) for part in value.split(",")]
    return key, numbers if len(numbers) > 1 else numbers[0]


def _factory(spec: str) -> Callable[[], Any]:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"Expected an .onnx file or package.module:factory, but got {spec!r}; e.g. ort_lightning.demo:digits_mlp."
        )
    factory = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {attribute!r}; name a function that builds the model.")
    return factory


def _example_inputs(shapes: list[str], dtypes: list[str]) -> tuple[Any, ...]:
    import torch

    if not shapes:
        raise ValueError("A torch factory needs --input-shape for each model input, e.g. --input-shape 64.")
    if dtypes and len(dtypes) != len(shapes):
        raise ValueError(f"Got {len(shapes)} --input-shape but {len(dtypes)} --input-dtype; give one per input.")
    examples = []
    for index, shape in enumerate(shapes):
        dims = [int(dim) for dim in shape.split(",") if dim]
        dtype = getattr(torch, dtypes[index] if dtypes else "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Unknown --input-dtype {dtypes[index]!r}; use a torch dtype name such as float32.")
        examples.append(torch.zeros((2, *dims), dtype=dtype))
    return tuple(examples)


# ----------------------------------------------------------------------------- inspect
def _inspect(args: argparse.Namespace) -> None:
    path: Path = args.path
    if path.is_dir():
        _describe_artifacts(path)
    elif path.is_file():
        _describe_checkpoint(path)
    else:
        raise FileNotFoundError(f"{path} does not exist; pass an artifacts folder or an ORT checkpoint file.")


def _describe_artifacts(directory: Path) -> None:
    from ort_lightning import TrainingArtifacts

    artifacts = TrainingArtifacts.load(directory)
    manifest = artifacts.manifest
    print(f"artifacts:  {artifacts.directory}")
    for title, specs in (("inputs", manifest.inputs), ("labels", manifest.labels)):
        for spec in specs:
            print(f"{title + ':':<11} {spec.name} {spec.dtype} [{', '.join(map(str, spec.shape))}]")
    print(f"outputs:    {', '.join(manifest.outputs) or '-'}  (loss: {manifest.loss} -> {manifest.loss_output})")
    options = " ".join(f"{key}={value}" for key, value in manifest.optimizer_options.items())
    print(f"optimizer:  {manifest.optimizer} {options}".rstrip())
    _describe_checkpoint(artifacts.checkpoint, header=False)
    for title, names in _initializer_roles(artifacts):
        print(f"{title + ':':<11} {', '.join(names) or '-'}")
    print("versions:   " + ", ".join(f"{name} {version}" for name, version in manifest.versions.items()))


def _initializer_roles(artifacts: Any) -> list[tuple[str, list[str]]]:
    """Which tensors train, which are frozen or buffers, and which float initializers stay constants."""
    import onnx

    manifest = artifacts.manifest
    state = {*manifest.trainable, *manifest.frozen, *manifest.buffers}
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
    graph = onnx.load(artifacts.eval_model, load_external_data=False).graph
    constants = sorted(t.name for t in graph.initializer if t.data_type in floating and t.name not in state)
    return [("trains", list(manifest.trainable)), ("frozen", list(manifest.frozen)),
            ("buffers", list(manifest.buffers)), ("constants", constants)]


def _describe_checkpoint(path: Path, *, header: bool = True) -> None:
    from ort_lightning import _ort
    from ort_lightning._atomic import verify_digest

    verify_digest(path)  # a sidecar written by ORTCheckpoint guards against silent corruption
    try:
        parameters, properties = _ort.checkpoint_summary(path)
    except Exception as error:  # ORT raises its own types for a file it cannot parse
        raise ValueError(f"{path} is not an ONNX Runtime checkpoint ({' '.join(str(error).split())[:200]}).") from error
    trainable = sum(math.prod(shape) for _, shape, grad in parameters if grad)
    total = sum(math.prod(shape) for _, shape, _ in parameters)
    if header:
        print(f"checkpoint: {path}")
    print(f"parameters: {total:,} values in {len(parameters)} tensors ({trainable:,} trainable)")
    for name, value in sorted(properties.items()):
        print(f"{name + ':':<11} {value}")


# ----------------------------------------------------------------------------- LightningCLI
def _lightning_cli(args: list[str]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    from ort_lightning import ORTLightningModule

    LightningCLI(
        ORTLightningModule,
        pl.LightningDataModule,
        subclass_mode_data=True,
        # NOTE: the optimizer and schedule come from the ORT artifacts, never from CLI flags.
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
