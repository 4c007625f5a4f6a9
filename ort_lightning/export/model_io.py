"""Models whose forward takes keyword inputs or returns a mapping (Hugging Face's `ModelOutput`).

Such a model is exported through a thin adapter that feeds the keywords and picks the outputs by
name; the adapter's ``model.`` prefix is stripped, so parameters keep torch's names.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import torch

from ort_lightning.errors import ExportError
from ort_lightning.export.diagnose import input_error

__all__ = ["PREFIX", "IOPlan", "copy_sharing_parameters", "plan_io", "strip_prefix", "users_model"]

#: Where the adapter keeps the user's model; stripped from every initializer name after export.
PREFIX = "model."


class _Adapter(torch.nn.Module):
    """Calls ``model(**dict(zip(keywords, tensors)))`` (or positionally) and returns the named outputs."""

    def __init__(self, model: torch.nn.Module, keywords: Sequence[str] | None, outputs: Sequence[str] | None) -> None:
        super().__init__()
        self.model = model
        self.keywords = list(keywords) if keywords is not None else None
        self.outputs = list(outputs) if outputs is not None else None

    def forward(self, *tensors: torch.Tensor) -> Any:
        if self.keywords is None:
            result = self.model(*tensors)
        else:
            result = self.model(**dict(zip(self.keywords, tensors, strict=True)))
        if self.outputs is None:
            return result
        return tuple(result[name] for name in self.outputs)


@dataclass(frozen=True)
class IOPlan:
    """What to export: the module (the model or an adapter around it), its inputs and the names."""

    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    input_names: list[str] | None
    output_names: list[str] | None
    prefix: str | None


def _keywords(example_inputs: Mapping[str, Any], input_names: Sequence[str] | None) -> list[str]:
    if input_names is not None and list(input_names) != list(example_inputs):
        raise ExportError(
            f"`input_names` {list(input_names)} disagree with the keys of the example_inputs dict "
            f"{list(example_inputs)}; the dict's keys name the graph's inputs, so leave input_names out."
        )
    bad = [key for key, value in example_inputs.items() if not isinstance(value, torch.Tensor)]
    if bad:
        raise ExportError(
            f"Expected every value of the example_inputs dict to be a tensor, but {bad} are not; pass only "
            "tensor inputs (set other forward arguments on the model or its config)."
        )
    return list(example_inputs)


def _pick(keys: Sequence[str], output: str | None, model_returns_loss: bool, model: str) -> list[str]:
    """The mapping keys that become graph outputs: the loss first when the model returns it."""
    wanted = output if output is not None else ("logits" if "logits" in keys or not model_returns_loss else None)
    if wanted is not None and wanted not in keys:
        raise ExportError(
            f"{model} returns outputs {list(keys)}, but output={wanted!r} is not among them; pass "
            f"export_artifacts(..., output=<one of {list(keys)}>)."
        )
    if not model_returns_loss:
        return [wanted] if wanted is not None else []
    if "loss" not in keys:
        raise ExportError(
            f"loss=None trains on the model's own loss, but {model} returns {list(keys)} without 'loss'; put "
            "the labels among example_inputs (e.g. {'input_ids': ..., 'labels': ...}) or pass a loss."
        )
    return ["loss"] + ([wanted] if wanted not in (None, "loss") else [])


def copy_sharing_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters are the model's own tensors (buffers and the rest copied).

    NOTE: a training-mode trace writes buffers, never parameters; sharing them spares copying a large model.
    """
    return copy.deepcopy(model, memo={id(parameter): parameter for parameter in model.parameters()})


def plan_io(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    input_names: Sequence[str] | None,
    output: str | None,
    model_returns_loss: bool,
) -> IOPlan:
    """Decide how to export `model`: as it is, or through the keyword/output adapter.

    Raises:
        ExportError: for an `output` the model does not return, a mapping without ``loss`` under
            ``loss=None``, `input_names` that contradict the dict, or `output` on unnamed outputs.
    """
    keywords = _keywords(example_inputs, input_names) if isinstance(example_inputs, Mapping) else None
    inputs = tuple(example_inputs.values()) if keywords is not None else _as_tuple(example_inputs)
    probe = _Adapter(copy_sharing_parameters(model).train(), keywords, None)
    try:
        with torch.no_grad():
            result = probe(*inputs)
    except Exception as error:  # the user's forward may raise anything; on these inputs, they are the cause
        shapes = [f"{key}: {tuple(t.shape)}" for key, t in zip(keywords or range(len(inputs)), inputs, strict=True)]
        raise input_error(error, model, shapes) from error
    name = type(model).__name__
    if isinstance(result, Mapping):
        outputs = _pick([key for key in result if result[key] is not None], output, model_returns_loss, name)
        return IOPlan(_Adapter(model, keywords, outputs), inputs, keywords, outputs, PREFIX)
    if output is not None:
        raise ExportError(
            f"output={output!r} picks an output by name, but {name} returns {type(result).__name__}, whose "
            "outputs have no names; leave `output` out (the first output feeds the loss)."
        )
    if keywords is None:
        return IOPlan(model, inputs, list(input_names) if input_names else None, None, None)
    return IOPlan(_Adapter(model, keywords, None), inputs, keywords, None, PREFIX)


def users_model(module: torch.nn.Module) -> tuple[torch.nn.Module, str | None]:
    """The user's model inside `module` (the adapter's, or `module` itself) and the prefix its names carry there."""
    if isinstance(module, _Adapter):
        return module.model, PREFIX
    return module, None


def _as_tuple(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(tensor, torch.Tensor) for tensor in inputs):
        raise ExportError(
            "Expected `example_inputs` to be a tensor or a tuple of tensors (or a dict of keyword tensors), as "
            f"the model's forward takes them, but got {type(example_inputs).__name__}."
        )
    return inputs


def strip_prefix(proto: onnx.ModelProto, prefix: str) -> None:
    """Rename initializers ``<prefix>name`` to ``name``, and every use of them, in place."""
    renamed = {
        tensor.name: tensor.name[len(prefix):] for tensor in proto.graph.initializer if tensor.name.startswith(prefix)
    }
    for tensor in proto.graph.initializer:
        tensor.name = renamed.get(tensor.name, tensor.name)
    for node in proto.graph.node:
        for index, name in enumerate(node.input):
            if name in renamed:
                node.input[index] = renamed[name]
    for info in proto.graph.input:
        info.name = renamed.get(info.name, info.name)
