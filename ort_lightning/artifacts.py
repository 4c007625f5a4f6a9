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

from ort_lightning import _export, _legalize, _ort
from ort_lightning._manifest import MANIFEST_NAME, Manifest, TensorSpec
from ort_lightning.errors import ArtifactError, ExportError

__all__ = ["MANIFEST_NAME", "Manifest", "TensorSpec", "TrainingArtifacts", "export_artifacts"]

_FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}
_LOSSES = tuple(_ort.LOSS_LABEL_NAMES)
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


def _check_loss(loss: object) -> str:
    if loss is None:
        return "model"
    if _ort.is_block(loss):
        return "custom"
    if loss not in _LOSSES:
        raise ExportError(
            f"Expected `loss` to be one of {list(_LOSSES)}, an onnxblock.Block, or None (the model returns "
            f"its loss), but got {loss!r}."
        )
    return str(loss)


def _as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(tensor, torch.Tensor) for tensor in inputs):
        raise ExportError(
            "Expected `example_inputs` to be a tensor or a tuple of tensors, as the model's forward takes "
            f"them, but got {type(example_inputs).__name__}."
        )
    return inputs


def _source_proto(
    model: ModelSource, example_inputs: Any, input_names: Sequence[str] | None, model_returns_loss: bool
) -> tuple[onnx.ModelProto, set[str], set[str]]:
    """Return the forward graph, its parameter initializers and its buffer initializers."""
    if isinstance(model, torch.nn.Module):
        inputs = _as_tuple(example_inputs)
        names = list(input_names) if input_names else _export.default_input_names(len(inputs))
        proto = _export.torch_to_onnx(model, inputs, input_names=names, model_returns_loss=model_returns_loss)
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
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16}
    parameters = {t.name for t in proto.graph.initializer if t.data_type in floating} - buffers
    return proto, parameters, buffers


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
) -> TrainingArtifacts:
    """Turn a torch module or an ONNX model into ONNX Runtime training artifacts.

    Args:
        model: a ``torch.nn.Module``, an ``onnx.ModelProto``, or the path of an ``.onnx`` file.
        example_inputs: a tensor or tuple of tensors the module's forward takes (torch models only);
            the first dimension of every input and output becomes a dynamic batch dimension.
        output_dir: folder for the artifacts; created if missing, files in it overwritten.
        loss: ``"cross_entropy"`` (labels ``labels``, int64), ``"mse"``, ``"bce_with_logits"``,
            ``"l1"`` (target ``target``, like the output), a custom ``onnxblock.Block``, or None
            when the model's first output is already the loss.
        optimizer: ``"adamw"`` (torch.optim.AdamW's defaults) or ``"sgd"`` (plain ``w -= lr * g``).
        optimizer_options: for AdamW ``betas``, ``eps``, ``weight_decay``.
        frozen: names of parameters (``named_parameters()`` names) that must not train; torch
            parameters with ``requires_grad=False`` are frozen too, as they are in torch.
        input_names: names of the model inputs (default ``input`` or ``input_0``, ``input_1`` ...).

    Returns:
        The validated `TrainingArtifacts`.

    Before ORT builds the training graphs, every node it cannot differentiate is rewritten into
    an exact equivalent it can (``_legalize.RULES``; docs/ops.md lists what trains).

    Raises:
        ExportError: for an unknown loss, optimizer, option or frozen name, a model that cannot be
            exported, or a layer ORT cannot differentiate and no rewrite covers (the message names
            the ONNX op, the node and the torch module).
    """
    loss_kind = _check_loss(loss)
    options = _normalize_optimizer(optimizer, optimizer_options)
    proto, parameters, buffers = _source_proto(model, example_inputs, input_names, loss is None)
    _export.check_opset(proto, _describe(model))
    _export.lower_ir_version(proto)
    _export.add_log_prob_outputs(proto)
    _legalize.legalize(proto, padding_rows=_legalize.padding_rows_of(model))
    trainable, frozen_names = _split_parameters(parameters, [*frozen, *_frozen_in_torch(model, parameters, frozen)])

    model_outputs = [output.name for output in proto.graph.output]
    model_inputs = [info.name for info in proto.graph.input]
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _generate(
        proto,
        trainable=trainable,
        frozen=[*frozen_names, *sorted(buffers)],
        loss=loss,
        optimizer=optimizer,
        optimizer_options=options,
        directory=folder,
        extra_outputs=[] if loss is None else model_outputs,
        loss_inputs=None if loss is None else model_outputs[:1],
    )
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
        loss_output=training_outputs[0],
        outputs=tuple(model_outputs[1:] if loss is None else model_outputs),
        optimizer=optimizer,
        optimizer_options=options,
        trainable=tuple(trainable),
        frozen=tuple(frozen_names),
        buffers=tuple(sorted(buffers)),
        versions=_versions(),
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
