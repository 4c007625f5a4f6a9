"""Losses as torch users write them: a loss name or a torch loss module becomes a `LossSpec`.

Example::

    >>> import torch
    >>> spec = resolve_loss(torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="sum"))
    >>> spec.kind, spec.options, spec.label
    ('cross_entropy', {'reduction': 'sum', 'ignore_index': -100, 'label_smoothing': 0.0}, 'labels')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from torch import nn

from ort_lightning.errors import ExportError
from ort_lightning.export.losses.graphs import CLASS_LOSSES, build_loss
from ort_lightning.export.onnx_nodes import ai_onnx_opset

__all__ = ["LOSS_NAMES", "LossSpec", "check_class_axis", "resolve_loss"]

#: Loss name -> the torch module it means, with torch's defaults.
_NAMED: dict[str, Callable[[], nn.Module]] = {
    "cross_entropy": nn.CrossEntropyLoss,
    "mse": nn.MSELoss,
    "bce_with_logits": nn.BCEWithLogitsLoss,
    "l1": nn.L1Loss,
    "nll": nn.NLLLoss,
    "smooth_l1": nn.SmoothL1Loss,
    "huber": nn.HuberLoss,
}
LOSS_NAMES = tuple(_NAMED)

#: torch loss class -> (kind, the options it reads beyond `reduction`).
_MODULES: dict[type[nn.Module], tuple[str, tuple[str, ...]]] = {
    nn.CrossEntropyLoss: ("cross_entropy", ("weight", "ignore_index", "label_smoothing")),
    nn.NLLLoss: ("nll", ("weight", "ignore_index")),
    nn.MSELoss: ("mse", ()),
    nn.L1Loss: ("l1", ()),
    nn.BCEWithLogitsLoss: ("bce_with_logits", ("weight", "pos_weight")),
    nn.SmoothL1Loss: ("smooth_l1", ("beta",)),
    nn.HuberLoss: ("huber", ("delta",)),
}


@dataclass(frozen=True)
class LossSpec:
    """A loss `export_artifacts` builds into the graphs: `kind`, `options` and `torch_module`."""

    kind: str
    options: dict[str, Any]
    torch_module: nn.Module = field(compare=False)

    @property
    def label(self) -> str:
        """Name of the label input: ``labels`` for class indices, else ``target``."""
        return "labels" if self.kind in CLASS_LOSSES else "target"

    def build(self, model: onnx.ModelProto, output: str) -> str:
        """Append this loss over `output` to `model`'s graph; return the loss output's name."""
        opset = ai_onnx_opset(model)
        needed = self._opset()
        if opset < needed:
            raise ExportError(
                f"loss={self.kind!r} is built with ai.onnx opset {needed} operators, but the model uses opset "
                f"{opset}; re-export it with opset_version >= {needed} or convert it with onnx.version_converter."
            )
        return build_loss(model.graph, self.kind, self.options, output=output, label=self.label)

    def _opset(self) -> int:
        """Gathered class indices take Squeeze/Unsqueeze axes as inputs (opset 13); SCE needs 12."""
        if self.kind == "nll" or self.options.get("label_smoothing"):
            return 13
        return 12 if self.kind == "cross_entropy" else 1


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().tolist()
    return value


def _from_module(loss: nn.Module) -> LossSpec:
    kind, names = _MODULES[type(loss)]
    reduction = loss.reduction
    if reduction not in ("mean", "sum"):
        raise ExportError(
            f"{type(loss).__name__}(reduction={reduction!r}) gives one loss per element, but training needs a "
            "scalar loss; use reduction='mean' or 'sum', or reduce inside the model and export with loss=None."
        )
    options: dict[str, Any] = {"reduction": reduction}
    for name in names:
        value = _plain(getattr(loss, name, None))
        if value is not None or name not in ("weight", "pos_weight"):
            options[name] = value
    return LossSpec(kind, options, loss)


def resolve_loss(loss: object) -> LossSpec:
    """Turn a loss name or a supported torch loss module into a `LossSpec` (`ExportError` naming the supported ones)."""
    if isinstance(loss, str) and loss in _NAMED:
        return _from_module(_NAMED[loss]())
    if isinstance(loss, nn.Module) and type(loss) in _MODULES:
        return _from_module(loss)
    supported = ", ".join(f"nn.{cls.__name__}" for cls in _MODULES)
    raise ExportError(
        f"Expected `loss` to be one of {list(LOSS_NAMES)}, a torch loss module ({supported}), an "
        f"onnxblock.Block, or None (the model returns its loss), but got {loss!r}; write another loss as an "
        "onnxblock.Block, or compute it in the model's forward and export with loss=None."
    )


def _dims(info: onnx.ValueInfoProto) -> list[int | str]:
    return [dim.dim_param or dim.dim_value for dim in info.type.tensor_type.shape.dim]


def _token_inputs(model: onnx.ModelProto) -> list[tuple[str, list[int | str]]]:
    integers = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    initializers = {tensor.name for tensor in model.graph.initializer}
    return [
        (info.name, _dims(info))
        for info in model.graph.input
        if info.name not in initializers and info.type.tensor_type.elem_type in integers
    ]


def _same_positions(tokens: list[int | str], positions: list[int | str]) -> bool:
    """Equal dims, a dim the exporter left symbolic (other than the batch) matching any size."""
    return len(tokens) == len(positions) and all(
        a == b or (isinstance(b, str) and b != "batch") for a, b in zip(tokens, positions, strict=True)
    )


def check_class_axis(spec: LossSpec, model: onnx.ModelProto, output: str) -> None:
    """Refuse class-index losses whose logits torch would read on another axis than meant.

    Torch takes axis 1; a language model's ``(B, T, V)`` logits over ``(B, T)`` ids would train on T.

    Raises:
        ExportError: for logits of rank < 2, or ``(B, T, V)`` logits over ``(B, T)`` token ids.
    """
    if spec.kind not in CLASS_LOSSES:
        return
    info = next((info for info in model.graph.output if info.name == output), None)
    dims = _dims(info) if info is not None else []
    if info is not None and len(dims) < 2:
        raise ExportError(
            f"{spec.kind} needs logits of shape (B, C) or (B, C, d1, ...), but output {output!r} has shape "
            f"{dims}; return a batch of class scores from the model."
        )
    if len(dims) < 3:
        return
    for name, token_dims in _token_inputs(model):
        if _same_positions(token_dims[1:], dims[1:-1]):
            vocab = dims[-1]
            raise ExportError(
                f"Output {output!r} has shape {dims}, like a language model's (B, T, V) logits over input "
                f"{name!r} {token_dims}, but {spec.kind} takes the class axis 1 as torch does (T here), so "
                f"(B, T) labels would train on the wrong axis. Flatten in the model's forward: return "
                f"logits.view(-1, {vocab}) (V = {vocab}) and feed labels.view(-1); or, for classes on axis 1, "
                "return logits.permute(0, 2, 1)."
            )
