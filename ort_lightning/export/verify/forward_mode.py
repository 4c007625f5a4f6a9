"""How the torch reference runs its forward: dropout off everywhere, ReLU kinks under watch.

`ReferenceMode` is one ``TorchFunctionMode`` for both. It zeroes ``dropout_p`` at the outer call
(a mode does not see calls inside the functions it intercepts; `without_dropout` zeroes the
modules' own rates). ReLU's gradient jumps at 0: where a float64 pre-activation lies within
float32's rounding of 0 (`KINK_FACTOR`), float32 may put it on either side, so the backward runs
with those masks as computed, all off and all on, and the spread is what rounding decides.

Example::

    >>> import torch
    >>> kinks = Kinks()
    >>> with ReferenceMode(kinks):
    ...     _ = torch.relu(torch.tensor([1e-9, 1.0]))
    >>> kinks.side = 0
    >>> with ReferenceMode(kinks, replay=True):
    ...     _ = torch.relu(torch.tensor([0.0, 1.0], dtype=torch.float64))
    >>> kinks.ambiguous
    1
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["KINK_FACTOR", "Kinks", "ReferenceMode", "without_dropout"]

#: Functions a torch forward drops out with; they return their input.
_DROPOUTS = frozenset(
    {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}
)
#: ReLU in all its spellings (in place ones return a new tensor here: the reference keeps no aliases).
_RELUS = frozenset({F.relu, F.relu_, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_})
#: Position of ``dropout_p`` in ``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p)``,
#: a builtin whose signature `inspect` cannot read.
_SDPA_DROPOUT_ARG = 4
# NOTE: measured on ResNet-18 (3x32x32, batch 8/9): ONNX Runtime's float32 convolutions are up to
# ~10x further from float64 than torch's (1.2e-5 vs ~1e-6 on activations of size 5); a ReLU input
# of 2.9e-6 flipped sign in ORT only. 32 covers that ratio with room.
KINK_FACTOR = 32.0


class Kinks:
    """The ReLU inputs of the float32 pass and the ambiguous elements of the float64 pass; ``side`` sets their mask."""

    def __init__(self) -> None:
        self.float32: list[torch.Tensor] = []
        self.ambiguous = 0
        self.side = 0
        self._next = 0

    def record(self, x: torch.Tensor) -> None:
        """Keep one ReLU input of the float32 pass."""
        self.float32.append(x.detach())

    def band(self, x: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the elements of float64 `x` that float32 rounding may put on either side of 0."""
        index, self._next = self._next, self._next + 1
        if index >= len(self.float32) or self.float32[index].shape != x.shape:
            return torch.zeros_like(x, dtype=torch.bool)
        error = (self.float32[index].to(x.dtype) - x.detach()).abs().max()
        band = x.detach().abs() <= KINK_FACTOR * error
        self.ambiguous += int(band.sum())
        return band


class _BandReLU(torch.autograd.Function):
    """ReLU whose backward mask on the ambiguous elements follows ``kinks.side``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, band: torch.Tensor, kinks: Kinks) -> torch.Tensor:
        ctx.save_for_backward(x, band)
        ctx.kinks = kinks
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, band = ctx.saved_tensors
        mask = x > 0
        if ctx.kinks.side < 0:
            mask = mask & ~band
        elif ctx.kinks.side > 0:
            mask = mask | band
        return grad * mask, None, None


def _signature(func: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _no_dropout_p(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Sequence[Any], dict[str, Any]]:
    """`args`, `kwargs` with a ``dropout_p`` argument of `func` set to 0 (unchanged when it has none)."""
    if func is F.scaled_dot_product_attention:
        if len(args) > _SDPA_DROPOUT_ARG:
            args = (*args[:_SDPA_DROPOUT_ARG], 0.0, *args[_SDPA_DROPOUT_ARG + 1 :])
        return args, {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
    signature = _signature(func)
    if signature is None or "dropout_p" not in signature.parameters:
        return args, kwargs
    position = list(signature.parameters).index("dropout_p")
    if len(args) > position:
        return (*args[:position], 0.0, *args[position + 1 :]), kwargs
    return args, {**kwargs, "dropout_p": 0.0}


class ReferenceMode(TorchFunctionMode):
    """Dropout off; ReLU inputs recorded (float32 pass) or banded against the record (`replay`, float64)."""

    def __init__(self, kinks: Kinks | None = None, *, replay: bool = False) -> None:
        super().__init__()
        self.kinks = kinks
        self.replay = replay

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func in _RELUS and self.kinks is not None:
            return self._relu(args[0] if args else kwargs["input"])
        args, kwargs = _no_dropout_p(func, args, kwargs)
        return func(*args, **kwargs)

    def _relu(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kinks is not None
        if not self.replay:
            self.kinks.record(x)
            return x.clamp_min(0)
        return _BandReLU.apply(x, self.kinks.band(x), self.kinks)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every ``nn.Dropout*``'s ``p`` and every float ``*dropout*`` attribute of `model`, in place."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name.lower() and isinstance(value, float):
                setattr(module, name, 0.0)
    return model
