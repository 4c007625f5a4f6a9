"""Torch parameters that stay views of ONNX Runtime's memory.

`bind_views` registers ORT's parameters on a module under the torch model's names, each
``.grad`` a view of ORT's gradient buffer; the step path re-binds them after each step, and
`check_conversion` refuses a dtype conversion that would copy them away.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ort_lightning.bridge import to_torch
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.runtime import TrainingSession

__all__ = [
    "GradientViews", "ORTParameters", "ParameterView", "bind_views", "check_conversion", "owner_of", "parameter_views",
]


@dataclass(frozen=True)
class ParameterView:
    """Torch views of one ORT parameter: its data and, when it trains, its gradient buffer."""

    name: str
    data: torch.Tensor
    grad: torch.Tensor | None
    trainable: bool


def parameter_views(session: TrainingSession) -> list[ParameterView]:
    """Torch tensors sharing memory with every parameter (and gradient) of the ORT state."""
    return [
        ParameterView(name, to_torch(data), None if grad is None else to_torch(grad), trainable)
        for name, data, grad, trainable in session.parameters()
    ]


class ORTParameters(torch.nn.Module):
    """A submodule of the torch model whose parameters and buffers live in ONNX Runtime's state (no forward)."""


class GradientViews:
    """The pairs (parameter, view of ORT's gradient buffer) of the trainable parameters."""

    def __init__(self, pairs: Sequence[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        self.pairs = tuple(pairs)
        self.grads = [grad for _, grad in self.pairs]


def owner_of(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The (created on demand) submodule of `root` holding `name`, and the leaf name."""
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            if hasattr(owner, part):
                raise ConfigurationError(
                    f"Parameter {name!r} clashes with the attribute {part!r} of {type(owner).__name__}; "
                    "rename that submodule of the torch model and export it again."
                )
            child = ORTParameters()
            owner.add_module(part, child)
        owner = child
    return owner, leaf


def bind_views(root: torch.nn.Module, views: Sequence[ParameterView], buffers: Collection[str]) -> GradientViews:
    """Register `views` on `root` (buffers for names in `buffers`), re-pointed; return the gradient views."""
    pairs = []
    for view in views:
        owner, leaf = owner_of(root, view.name)
        if view.name in buffers:
            owner.register_buffer(leaf, view.data)
            continue
        parameter = owner._parameters.get(leaf)
        if parameter is None:
            parameter = torch.nn.Parameter(view.data, requires_grad=view.trainable)
            owner.register_parameter(leaf, parameter)
        else:
            parameter.data = view.data
        if view.grad is not None:
            parameter.grad = view.grad
            pairs.append((parameter, view.grad))
    return GradientViews(pairs)


def check_conversion(fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
    """Refuse a tensor conversion `fn` (from ``module._apply``) that changes the dtype.

    Example::

        >>> import torch
        >>> check_conversion(lambda t: t.half(), torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ort_lightning.errors.ConfigurationError: ONNX Runtime trains this module in float32, ...
    """
    converted = fn(torch.empty(0, device=device))
    if converted.dtype != torch.float32:
        raise ConfigurationError(
            "ONNX Runtime trains this module in float32, and a conversion to "
            f"{str(converted.dtype).replace('torch.', '')} would copy the parameters away from the memory ORT "
            "updates; keep the module in float32 (no .half()/.double()/.to(dtype)) and export artifacts "
            "from a model of the dtype you want instead."
        )
