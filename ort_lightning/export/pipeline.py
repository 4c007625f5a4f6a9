"""`export_artifacts`: a torch module or an ONNX model becomes ONNX Runtime training artifacts.

The stages, each a module of this package: `source` (the forward graph), `before_generation`
(passes, legalization last), generation (ORT's ``generate_artifacts`` with the loss of
`losses/`), `after_generation`, `verify/` (one step against torch autograd), then the manifest
and what a device ships. Every stage writes into a staging folder that moves into place only
after the last one, so that a failure leaves an earlier export intact.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp())
    >>> [spec.name for spec in artifacts.manifest.inputs], [spec.name for spec in artifacts.manifest.labels]
    (['input'], ['labels'])
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from ort_lightning.artifacts import FILES, MANIFEST_NAME, UNVERIFIED_NAME, Manifest, TensorSpec, TrainingArtifacts
from ort_lightning.artifacts.checks import checkpoint_digest, remember_graph
from ort_lightning.errors import ExportError
from ort_lightning.export import after_generation, before_generation
from ort_lightning.export.adapters import refuse_dora
from ort_lightning.export.external import bytes_needed, external_data_wanted, weights_folder
from ort_lightning.export.legalize import engine as _legalize
from ort_lightning.export.losses.spec import LossSpec, check_class_axis, resolve_loss
from ort_lightning.export.source import ModelSource, load_source
from ort_lightning.export.verify.verifier import verify_export
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.graph_files import ort_inputs
from ort_lightning.pretrained.record import RECORD_DIR, write_record
from ort_lightning.storage.staging import staged_folder

__all__ = ["export_artifacts"]

_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    # torch.optim.AdamW's defaults, so that a PyTorch user gets what they expect.
    "adamw": {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    # ORT's SGDOptimizerV2 is plain `w -= lr * g`: no momentum, no weight decay.
    "sgd": {},
}


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


def _torch_names(model: ModelSource) -> set[str]:
    """Every ``named_parameters()`` name of a torch model, read by its forward or not (none for ONNX)."""
    return {name for name, _ in model.named_parameters()} if isinstance(model, torch.nn.Module) else set()


def _split_parameters(
    parameters: set[str], frozen: Sequence[str], unused: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """Trainable and frozen graph parameters; frozen names in `unused` (never read by the forward) are dropped."""
    # NOTE: peft keeps the replaced head as classifier.original_module.* beside the trained copy; the
    # forward never reads it, so the graph has no such tensor, yet the natural frozen= list names it.
    frozen = [name for name in frozen if name in parameters or name not in unused]
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
    proto: onnx.ModelProto, state: set[str], model_inputs: Sequence[str]
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Split the user inputs of the training graph into model inputs and labels."""
    added = ort_inputs([info.name for info in proto.graph.input])
    user = [
        TensorSpec.from_value_info(info)
        for info in proto.graph.input
        if info.name not in state and info.name not in added
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
    ort_format: bool = False,
    nominal_checkpoint: bool = False,
    external_data: bool | None = None,
) -> TrainingArtifacts:
    """Turn a torch module or an ONNX model into ONNX Runtime training artifacts.

    Every node ORT cannot differentiate is first rewritten into an exact equivalent it can
    (``export.legalize.RULES``; docs/ops.md lists what trains).

    Args:
        model: a ``torch.nn.Module`` (trains its ``named_parameters()``), an ``onnx.ModelProto`` or the
            path of an ``.onnx`` file (trains its floating-point weights read at differentiable inputs;
            ``ort-lightning inspect`` lists them).
        example_inputs: a tensor, tuple of tensors or dict of keyword tensors for the forward (torch
            models only); the first dimension of every input and output becomes the batch dimension.
        output_dir: folder for the artifacts; created if missing, the export's files replaced only when
            every stage has passed.
        loss: ``"cross_entropy"``, ``"nll"`` (labels ``labels``, int64), ``"mse"``, ``"bce_with_logits"``,
            ``"l1"``, ``"smooth_l1"``, ``"huber"`` (target ``target``), a torch loss module with its options,
            a custom ``onnxblock.Block``, or None when the model's first output is the loss.
        optimizer: ``"adamw"`` (torch.optim.AdamW's defaults) or ``"sgd"`` (plain ``w -= lr * g``).
        optimizer_options: for AdamW ``betas``, ``eps``, ``weight_decay``.
        frozen: ``named_parameters()`` names that must not train (``requires_grad=False`` ones too).
        input_names: names of the model inputs (default ``input`` or ``input_0``, ``input_1`` ...).
        verify: run one training step of the new artifacts in a child process and compare the loss and
            every gradient with float64 torch autograd (report in ``manifest.verification``).
        output: for a model that returns a mapping, the key of the output the loss reads (``"logits"``).
        ort_format: also write the ``.ort`` graphs a mobile build of ONNX Runtime loads.
        nominal_checkpoint: also write ``nominal_checkpoint`` (names and shapes, no weights).
        external_data: keep the weights out of the graphs while exporting (a model over 2 GB exports);
            None does so for every torch module and for ONNX sources over 1 GiB.

    Returns:
        The validated `TrainingArtifacts`.

    Raises:
        ExportError: for an unknown loss, option, optimizer or frozen name, a peft DoRA adapter, an
            ambiguous class axis, a model that cannot be exported, a layer ORT cannot differentiate
            (naming the op, node and torch module), or artifacts whose first step fails or disagrees
            with torch autograd.
        StorageError: when `output_dir`'s file system has too little space; nothing there has changed.
    """
    loss_kind, loss_spec = _check_loss(loss)
    options = _normalize_optimizer(optimizer, optimizer_options)
    refuse_dora(model)
    external = external_data_wanted(model, external_data)
    # NOTE: every file is written into a staging folder and moved into place only when all stages have
    # passed, so that a full disk or a failing stage leaves an earlier export in `output_dir` as it was.
    with staged_folder(
        output_dir, needed=bytes_needed(model, external=external), last=(MANIFEST_NAME,),
        obsolete=(UNVERIFIED_NAME, RECORD_DIR),
    ) as folder:
        with weights_folder(folder, external=external) as weights_dir:
            # 1. source
            proto, parameters, buffers = load_source(
                model, example_inputs, input_names, loss is None, output, weights_dir=weights_dir
            )
            trainable, frozen_names = _split_parameters(
                parameters, [*frozen, *_frozen_in_torch(model, parameters, frozen)], _torch_names(model) - parameters
            )
            # 2. passes before generation
            before_generation.prepare(proto, model=model, weights_dir=weights_dir)
            model_inputs = [info.name for info in proto.graph.input]
            model_outputs = [info.name for info in proto.graph.output]
            # 3. generation
            _generate(
                proto,
                loss if loss_spec is None else loss_spec,
                trainable=trainable,
                frozen=[*frozen_names, *sorted(buffers)],
                optimizer=optimizer,
                optimizer_options=options,
                directory=folder,
                weights_dir=weights_dir,
            )
        # 4. passes after generation
        graphs = after_generation.finish_graphs({name: folder / FILES[name] for name in FILES}, optimizer=optimizer)
        training_graph = graphs["training_model"]
        # 5. verification, 6. the manifest
        state = set(trainable) | set(frozen_names) | buffers
        inputs, labels = _graph_io(training_graph, state, model_inputs)
        manifest = Manifest(
            inputs=tuple(inputs),
            labels=tuple(labels),
            loss=loss_kind,
            loss_options=loss_spec.options if loss_spec is not None else {},
            loss_output=training_graph.graph.output[0].name,
            outputs=tuple(model_outputs[1:] if loss is None else model_outputs),
            optimizer=optimizer,
            optimizer_options=options,
            trainable=tuple(trainable),
            frozen=tuple(frozen_names),
            buffers=tuple(sorted(buffers)),
            versions=_versions(),
            parameter_order=_model_order(model, training_graph, state),
            checkpoint_sha256=checkpoint_digest(folder / FILES["checkpoint"]),
        )
        manifest = verify_export(
            manifest, folder, model=model, example_inputs=example_inputs, loss=loss, output=output, enabled=verify,
            training_graph=training_graph,
        )
        (folder / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        # NOTE: what rebuilds a transformers or peft model for the write-back (ort_lightning.save_pretrained).
        write_record(model, folder)
        # 7. what a device ships, from the final graphs
        _ort.write_device_files(
            folder, [folder / FILES[name] for name in ("training_model", "eval_model", "optimizer_model")],
            folder / FILES["checkpoint"], ort_format=ort_format, nominal_checkpoint=nominal_checkpoint,
        )
    for name, graph in graphs.items():  # NOTE: the folder check takes the graphs as written, not read back
        remember_graph(Path(output_dir) / FILES[name], graph)
    return TrainingArtifacts.load(output_dir)


def _model_order(model: Any, training_graph: onnx.ModelProto, state: set[str]) -> tuple[str, ...]:
    """The state's names in the torch module's order (parameters, then buffers), the rest in the graph's.

    NOTE: ONNX Runtime lists a checkpoint's parameters alphabetically.
    """
    names: list[str] = []
    if isinstance(model, torch.nn.Module):
        names = [name for name, _ in (*model.named_parameters(), *model.named_buffers()) if name in state]
    listed = set(names)
    names += [info.name for info in training_graph.graph.input if info.name in state and info.name not in listed]
    return tuple(names)


def _generate(proto: onnx.ModelProto, loss: LossSpec | Any | None, **options: Any) -> None:
    """The generation stage: ORT's ``generate_artifacts`` with `loss` over the model's first output."""
    outputs = [info.name for info in proto.graph.output]
    if isinstance(loss, LossSpec):
        check_class_axis(loss, proto, outputs[0])
    build = loss.build if isinstance(loss, LossSpec) else loss
    try:
        _ort.generate(
            proto, loss=build, extra_outputs=[] if loss is None else outputs,
            loss_inputs=None if loss is None else outputs[:1], **options,
        )
    except ExportError as error:
        _legalize.raise_explained(proto, error)
        raise


def _versions() -> dict[str, str]:
    from ort_lightning._version import __version__

    return {
        "ort_lightning": __version__, "onnx": onnx.__version__, "torch": torch.__version__, **_ort.versions()
    }
