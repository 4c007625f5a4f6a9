"""Training artifacts: `export_artifacts` writes them, `TrainingArtifacts.load` validates them.

A set of artifacts is a folder with ``training_model.onnx``, ``eval_model.onnx``,
``optimizer_model.onnx``, ``checkpoint`` and the manifest ``ort_lightning.json`` that says
which inputs, labels and outputs the graphs have and how they were made.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts, TrainingArtifacts
    >>> folder = tempfile.mkdtemp()
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder)
    >>> [spec.name for spec in artifacts.manifest.inputs], [spec.name for spec in artifacts.manifest.labels]
    (['input'], ['labels'])
    >>> TrainingArtifacts.load(folder).manifest.optimizer
    'adamw'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import onnx
import torch

from ort_lightning import _batchnorm, _export, _legalize, _ort, _weights
from ort_lightning._losses import LossSpec, check_class_axis, resolve_loss
from ort_lightning._manifest import MANIFEST_NAME, Manifest, TensorSpec
from ort_lightning._model_io import plan_io, strip_prefix
from ort_lightning._verify import verify_export
from ort_lightning.errors import ArtifactError, ExportError

__all__ = ["MANIFEST_NAME", "Manifest", "TensorSpec", "TrainingArtifacts", "export_artifacts"]

_FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}
_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    # torch.optim.AdamW's defaults, so that a PyTorch user gets what they expect.
    "adamw": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    # ORT's SGDOptimizerV2 is plain `w -= lr * g`: no momentum, no weight decay.
    "sgd": {},
}

ModelSource = Union[torch.nn.Module, onnx.ModelProto, str, "os.PathLike[str]"]


@dataclass(frozen=True)
class TrainingArtifacts:
    """A validated artifacts folder: the paths of its four files and its manifest."""

    directory: Path
    manifest: Manifest

    @property
    def training_model(self) -> Path:
        """Forward, loss and gradient graph."""
        return self.directory / _FILES["training_model"]

    @property
    def eval_model(self) -> Path:
        """Forward and loss graph in inference mode (Dropout off, BatchNorm running statistics)."""
        return self.directory / _FILES["eval_model"]

    @property
    def optimizer_model(self) -> Path:
        """Optimizer update graph."""
        return self.directory / _FILES["optimizer_model"]

    @property
    def checkpoint(self) -> Path:
        """Initial parameters as an ORT CheckpointState file."""
        return self.directory / _FILES["checkpoint"]

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> TrainingArtifacts:
        """Validate an artifacts folder and read its manifest.

        Raises:
            ArtifactError: for a missing folder or file, a missing or foreign manifest, or a graph
                whose ONNX IR version ORT 1.19.2 cannot read.
        """
        folder = _check_folder(Path(directory))
        manifest_path = folder / MANIFEST_NAME
        if not manifest_path.is_file():
            raise ArtifactError(
                f"{folder} has no {MANIFEST_NAME}, so it was not written by export_artifacts(); export the "
                "model with export_artifacts() (it also accepts an ONNX file)."
            )
        manifest = Manifest.from_json(manifest_path.read_text(encoding="utf-8"), manifest_path)
        _check_versions(manifest, manifest_path)
        artifacts = cls(folder, manifest)
        for name in _FILES:
            path = getattr(artifacts, name)
            if not path.is_file():
                raise ArtifactError(
                    f"Artifact {path} is missing; re-export the folder with export_artifacts() rather than "
                    "copying files by hand."
                )
        for name in ("training_model", "eval_model", "optimizer_model"):
            _check_ir_version(getattr(artifacts, name))
        return artifacts


def _check_folder(folder: Path) -> Path:
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ArtifactError(
            f"{folder} is not a folder; pass the folder that export_artifacts() wrote (here perhaps "
            f"{folder.parent}), not one of its files."
        )
    raise ArtifactError(
        f"Artifacts folder {folder} does not exist; create it with "
        "export_artifacts(model, example_inputs, output_dir)."
    )


def _release(version: str) -> tuple[str, ...]:
    """Major and minor of a version string: ``"1.19.2" -> ("1", "19")``."""
    return tuple(version.split("+")[0].split(".")[:2])


def _check_versions(manifest: Manifest, source: Path) -> None:
    """Refuse artifacts whose graphs another ONNX Runtime release generated."""
    written = manifest.versions.get("onnxruntime")
    installed = _ort.versions()["onnxruntime"]
    if written is not None and _release(written) != _release(installed):
        raise ArtifactError(
            f"{source} says these artifacts were generated by onnxruntime {written}, but {installed} is "
            f"installed, and training graphs are only read by the release that wrote them; re-export the "
            f"model with export_artifacts() here, or install onnxruntime-training=={written}."
        )


def _check_ir_version(path: Path) -> None:
    try:
        ir_version = onnx.load(path, load_external_data=False).ir_version
    except Exception as error:  # onnx raises DecodeError and friends for a damaged file
        raise ArtifactError(
            f"{path} is not a readable ONNX model ({error}); re-export the artifacts."
        ) from error
    if ir_version > _export.MAX_IR_VERSION:
        raise ArtifactError(
            f"{path} has ONNX IR version {ir_version}, but ONNX Runtime 1.19.2 reads IR <= "
            f"{_export.MAX_IR_VERSION}; re-export with export_artifacts() (it lowers the IR version) or "
            "install onnx==1.17.0 before generating artifacts."
        )


def _normalize_optimizer(optimizer: str, options: dict[str, Any] | None) -> dict[str, Any]:
    if optimizer not in _OPTIMIZER_DEFAULTS:
        raise ExportError(
            f"Expected `optimizer` to be one of {sorted(_OPTIMIZER_DEFAULTS)}, but got {optimizer!r}."
        )
    defaults = _OPTIMIZER_DEFAULTS[optimizer]
    unknown = sorted(set(options or {}) - set(defaults))
    if unknown:
        raise ExportError(
            f"Unknown optimizer_options {unknown} for {optimizer!r}; it accepts {sorted(defaults) or 'none'}"
            + (
                " (ORT's SGD has no momentum or weight decay; use optimizer='adamw' for those)."
                if not defaults
                else "."
            )
        )
    merged = {**defaults, **(options or {})}
    if "betas" in merged:
        merged["betas"] = [float(beta) for beta in merged["betas"]]
    return merged


def _check_loss(loss: object) -> tuple[str, LossSpec | None]:
    """The manifest's loss kind, and the `LossSpec` of a loss name or torch loss module."""
    if loss is None:
        return "model", None
    if _ort.is_block(loss):
        return "custom", None
    spec = resolve_loss(loss)
    return spec.kind, spec


def _source_proto(
    model: ModelSource,
    example_inputs: Any,
    input_names: Sequence[str] | None,
    model_returns_loss: bool,
    output: str | None = None,
) -> tuple[onnx.ModelProto, set[str], set[str]]:
    """Return the forward graph, its parameter initializers and its buffer initializers."""
    if isinstance(model, torch.nn.Module):
        plan = plan_io(
            model, example_inputs, input_names=input_names, output=output, model_returns_loss=model_returns_loss
        )
        names = plan.input_names or _export.default_input_names(len(plan.inputs))
        proto = _export.torch_to_onnx(
            plan.module, plan.inputs, input_names=names, model_returns_loss=model_returns_loss,
            output_names=plan.output_names,
        )
        if plan.prefix:
            strip_prefix(proto, plan.prefix)
        initializers = {tensor.name for tensor in proto.graph.initializer}
        parameters = {name for name, _ in model.named_parameters()} & initializers
        buffers = {name for name, _ in model.named_buffers()} & initializers
        return proto, parameters, buffers
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, (str, os.PathLike)):
        if not Path(model).is_file():
            raise ExportError(f"ONNX file {model} does not exist; pass the path of an exported .onnx model.")
        try:
            proto = onnx.load(os.fspath(model))
        except Exception as error:  # onnx raises DecodeError and friends for a damaged file
            raise ExportError(
                f"{model} is not a readable ONNX model ({error}); pass a file written by torch.onnx.export "
                "or onnx.save."
            ) from error
    else:
        raise ExportError(
            "Expected `model` to be a torch.nn.Module, an onnx.ModelProto or the path of an ONNX file, "
            f"but got {type(model).__name__}."
        )
    buffers = _export.buffer_inputs_of(proto)
    weights, _ = _weights.split_initializers(proto, buffers=buffers)
    return proto, set(weights), buffers


def _describe(model: ModelSource) -> str:
    """Name a model source in messages: a class name, a file path, or the ONNX graph's name."""
    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    if isinstance(model, onnx.ModelProto):
        return f"ONNX model (graph {model.graph.name!r})"
    return os.fspath(model)


def _split_parameters(parameters: set[str], frozen: Sequence[str]) -> tuple[list[str], list[str]]:
    unknown = sorted(set(frozen) - parameters)
    if unknown:
        raise ExportError(
            f"Cannot freeze {unknown}: not parameters of the model. Expected names from "
            f"{sorted(parameters)}; use the names of model.named_parameters()."
        )
    trainable = sorted(parameters - set(frozen))
    if not trainable:
        raise ExportError(
            "No parameter is left to train: every parameter is frozen or the model has none; "
            "unfreeze at least one parameter."
        )
    return trainable, sorted(frozen)


def _frozen_in_torch(model: ModelSource, parameters: set[str], frozen: Sequence[str]) -> list[str]:
    """Parameters the torch model itself freezes (``requires_grad=False``), not already named."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [n for n, p in model.named_parameters() if not p.requires_grad and n in parameters and n not in frozen]


def _graph_io(
    path: Path, state: set[str], model_inputs: Sequence[str]
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Split the user inputs of the training graph into model inputs and labels."""
    proto = onnx.load(path, load_external_data=False)
    user = [
        TensorSpec.from_value_info(info)
        for info in proto.graph.input
        if info.name not in state and not info.name.endswith(".buffer") and info.name != "lazy_reset_grad"
    ]
    return [s for s in user if s.name in model_inputs], [s for s in user if s.name not in model_inputs]


def export_artifacts(
    model: ModelSource,
    example_inputs: Any = None,
    output_dir: str | os.PathLike[str] = "artifacts",
    *,
    loss: str | Any | None = "cross_entropy",
    optimizer: str = "adamw",
    optimizer_options: dict[str, Any] | None = None,
    frozen: Sequence[str] = (),
    input_names: Sequence[str] | None = None,
    verify: bool = True,
    output: str | None = None,
) -> TrainingArtifacts:
    """Turn a torch module or an ONNX model into ONNX Runtime training artifacts.

    Args:
        model: a ``torch.nn.Module``, an ``onnx.ModelProto``, or the path of an ``.onnx`` file.
            A torch module trains its ``named_parameters()``. An ONNX model trains only its real
            weights: floating-point initializers of rank >= 1, other than BatchNorm running
            statistics, that some node reads at a differentiable input (not as a shape, axes,
            indices, Pow exponent, Dropout ratio, Clip bound ...); scalars and those other
            initializers stay constants (``ort-lightning inspect`` lists both).
        example_inputs: a tensor or tuple of tensors the module's forward takes (torch models only),
            or a dict of keyword tensors (``{"input_ids": ..., "attention_mask": ...}``), whose keys
            name the graph's inputs; the first dimension of every input and output becomes a dynamic
            batch dimension.
        output_dir: folder for the artifacts; created if missing, files in it overwritten.
        loss: ``"cross_entropy"`` or ``"nll"`` (labels ``labels``, int64, class axis 1 as in torch),
            ``"mse"``, ``"bce_with_logits"``, ``"l1"``, ``"smooth_l1"``, ``"huber"`` (target
            ``target``, like the output), a torch loss module with its options
            (``nn.CrossEntropyLoss(weight=, ignore_index=, reduction=, label_smoothing=)``,
            ``nn.NLLLoss``, ``nn.MSELoss``, ``nn.L1Loss``, ``nn.BCEWithLogitsLoss(weight=, pos_weight=)``,
            ``nn.SmoothL1Loss(beta=)``, ``nn.HuberLoss(delta=)``), a custom ``onnxblock.Block``, or
            None when the model's first output is already the loss (a ``ModelOutput``'s ``loss``).
        optimizer: ``"adamw"`` (torch.optim.AdamW's defaults) or ``"sgd"`` (plain ``w -= lr * g``).
        optimizer_options: for AdamW ``betas``, ``eps``, ``weight_decay``.
        frozen: names of parameters (``named_parameters()`` names) that must not train; torch
            parameters with ``requires_grad=False`` are frozen too, as they are in torch.
        input_names: names of the model inputs (default ``input`` or ``input_0``, ``input_1`` ...).
        verify: run one training step of the new artifacts in a child process, at the example's
            batch size and one more, and compare the loss and every gradient with torch autograd
            (ONNX sources and custom loss blocks: crash, error and finiteness only). The report is
            kept in ``manifest.verification``. False skips it (about 2 s per export).
        output: for a model that returns a mapping (Hugging Face's ``ModelOutput``), the key of the
            output the loss reads (default ``"logits"``); with ``loss=None`` it is kept next to ``loss``.

    Returns:
        The validated `TrainingArtifacts`.

    Before ORT builds the training graphs, every node it cannot differentiate is rewritten into
    an exact equivalent it can (``_legalize.RULES``; docs/ops.md lists what trains).

    Raises:
        ExportError: for an unknown loss, loss option, optimizer, option or frozen name, logits whose
            class axis is ambiguous, a model that cannot be exported, a layer ORT cannot differentiate
            and no rewrite covers (the message names the ONNX op, the node and the torch module), or
            artifacts whose first training step crashes, fails, or disagrees with torch autograd.
    """
    loss_kind, loss_spec = _check_loss(loss)
    options = _normalize_optimizer(optimizer, optimizer_options)
    proto, parameters, buffers = _source_proto(model, example_inputs, input_names, loss is None, output)
    _export.check_opset(proto, _describe(model))
    _export.lower_ir_version(proto)
    _export.add_log_prob_outputs(proto)
    _export.add_dropout_masks(proto)
    _legalize.legalize(proto, padding_rows=_legalize.padding_rows_of(model))
    trainable, frozen_names = _split_parameters(parameters, [*frozen, *_frozen_in_torch(model, parameters, frozen)])

    model_outputs = [info.name for info in proto.graph.output]
    if loss_spec is not None:
        check_class_axis(loss_spec, proto, model_outputs[0])
    model_inputs = [info.name for info in proto.graph.input]
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _generate(
        proto,
        trainable=trainable,
        frozen=[*frozen_names, *sorted(buffers)],
        loss=loss_spec.build if loss_spec is not None else loss,
        optimizer=optimizer,
        optimizer_options=options,
        directory=folder,
        extra_outputs=[] if loss is None else model_outputs,
        loss_inputs=None if loss is None else model_outputs[:1],
    )
    _batchnorm.torch_running_statistics(folder / _FILES["training_model"])
    _export.fix_eval_graph(folder / _FILES["eval_model"])
    if optimizer == "adamw":
        _export.set_torch_adamw_mode(folder / _FILES["optimizer_model"])
    _export.lower_ir_versions([folder / _FILES["training_model"], folder / _FILES["optimizer_model"]])

    state = set(trainable) | set(frozen_names) | buffers
    inputs, labels = _graph_io(folder / _FILES["training_model"], state, model_inputs)
    training_outputs = [o.name for o in onnx.load(folder / _FILES["training_model"]).graph.output]
    manifest = Manifest(
        inputs=tuple(inputs),
        labels=tuple(labels),
        loss=loss_kind,
        loss_options=loss_spec.options if loss_spec is not None else {},
        loss_output=training_outputs[0],
        outputs=tuple(model_outputs[1:] if loss is None else model_outputs),
        optimizer=optimizer,
        optimizer_options=options,
        trainable=tuple(trainable),
        frozen=tuple(frozen_names),
        buffers=tuple(sorted(buffers)),
        versions=_versions(),
    )
    manifest = verify_export(
        manifest, folder, model=model, example_inputs=example_inputs, loss=loss, output=output, enabled=verify
    )
    (folder / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
    return TrainingArtifacts.load(folder)


def _generate(proto: onnx.ModelProto, **options: Any) -> None:
    """`_ort.generate`, with a missing gradient explained by the node and torch module it comes from."""
    try:
        _ort.generate(proto, **options)
    except ExportError as error:
        _legalize.raise_explained(proto, error)
        raise


def _versions() -> dict[str, str]:
    from ort_lightning import __version__

    return {
        "ort_lightning": __version__, "onnx": onnx.__version__, "torch": torch.__version__, **_ort.versions()
    }
