"""The exported model again: built from its record (random weights, no download), then given the trained values.

`rebuild` reads the record with transformers' and peft's own readers and builds the model, its
adapters added in the recorded order; `load_values` copies ORT's state in by ``named_parameters()``
name (a tied weight is in ORT's state once, under torch's first name).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from ort_lightning.errors import ArtifactError, CheckpointError
from ort_lightning.pretrained.record import PretrainedRecord

__all__ = ["load_values", "rebuild"]


def _model_class(record: PretrainedRecord) -> Any:
    """The class the record names, imported (`ArtifactError` when it cannot be imported here)."""
    module, _, name = record.model_class.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ArtifactError(
            f"The model class {record.model_class} recorded in {record.directory} cannot be imported here ({error}); "
            "install the package that defines it (a transformers release that has it), or pass the model: "
            "save_pretrained(source, folder, model=model)."
        ) from error
    return found


def rebuild(record: PretrainedRecord) -> torch.nn.Module:
    """The recorded model with random weights, its peft adapters added and the active one set (`ArtifactError`)."""
    import transformers

    model_class = _model_class(record)
    # NOTE: the class's own config class, not AutoConfig: a model class of the user's need not be registered.
    model: Any = model_class(model_class.config_class.from_pretrained(record.directory))
    if (record.directory / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(record.directory)
    if not record.adapters:
        return model.eval()
    import peft

    first, *others = record.adapters
    adapter_configs = {
        name: peft.PeftConfig.from_pretrained(str(record.adapter_config(name))) for name in record.adapters
    }
    model = peft.get_peft_model(model, adapter_configs[first], adapter_name=first)
    for name in others:
        model.add_adapter(name, adapter_configs[name])
    if record.active_adapter is not None:
        model.set_adapter(record.active_adapter)
    return model.eval()


def load_values(model: torch.nn.Module, values: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Copy `values` (ORT's state by torch name) into `model`'s parameters and buffers.

    Every parameter a forward reads must get a value; buffers ORT does not hold (rotary frequencies)
    keep theirs.

    Raises:
        CheckpointError: for a value `model` has no tensor for, one of another shape, or a parameter
            left without a value.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> load_values(model, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}, source="a state")
        >>> model.weight.tolist()
        [[1.0, 1.0]]
    """
    parameters = dict(model.named_parameters(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {**parameters, **dict(model.named_buffers(remove_duplicate=False))}
    unknown = sorted(set(values) - set(tensors))
    shapes = [f"{name}: {tuple(value.shape)} vs {tuple(tensors[name].shape)}" for name, value in values.items()
              if name in tensors and tuple(value.shape) != tuple(tensors[name].shape)]
    problems = (("names it has no tensor for", unknown), ("shapes that differ", shapes))
    if unknown or shapes:
        raise CheckpointError(
            f"{source} does not fit the {type(model).__name__} it is written back into: "
            f"{', '.join(_listed(what, items) for what, items in problems if items)}; pass the "
            "model the artifacts were exported from (model=), or the artifacts the checkpoint was trained on."
        )
    given: set[int] = set()
    with torch.no_grad():
        for name, value in values.items():
            tensors[name].copy_(value)
            given.add(id(tensors[name]))
    given |= _never_read(model)
    missing = sorted(name for name, parameter in parameters.items() if id(parameter) not in given)
    if missing:
        raise CheckpointError(
            f"{source} holds no value for the parameters {missing[:8]}{' ...' if len(missing) > 8 else ''} of the "
            f"{type(model).__name__} it is written back into; pass the model the artifacts were exported from "
            "(model=), or the artifacts the checkpoint was trained on."
        )


def _never_read(model: torch.nn.Module) -> set[int]:
    """Parameters no forward reads (inactive adapters, ``original_module`` beside a copy): not in ORT's state."""
    unread: list[torch.nn.Module | torch.nn.Parameter] = []
    for module in model.modules():
        names = getattr(module, "active_adapters", None)  # NOTE: a list on peft's layers, a method on transformers'
        if not isinstance(names, list | tuple):
            continue
        active = set(names)
        layers = [getattr(module, name, None) for name in getattr(module, "adapter_layer_names", ())]
        layers.append(getattr(module, "modules_to_save", None))
        for layer in layers:
            if isinstance(layer, torch.nn.ModuleDict | torch.nn.ParameterDict):
                unread += [value for key, value in layer.items() if key not in active]
        original = getattr(module, "original_module", None)
        if hasattr(module, "modules_to_save") and isinstance(original, torch.nn.Module):
            unread.append(original)
    return {id(parameter) for item in unread
            for parameter in (item.parameters() if isinstance(item, torch.nn.Module) else [item])}


def _listed(what: str, items: list[str]) -> str:
    return f"{what} {items[:8]}{' ...' if len(items) > 8 else ''}"
