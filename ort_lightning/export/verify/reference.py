"""The torch side of export-time verification: inputs, labels and torch autograd's loss and gradients.

Inputs are the example's own rows, repeated to any batch size, so that normalization sees real
statistics; labels follow the training graph. The reference runs a training-mode copy with
dropout off (`forward_mode`) in float64, and again in float32 to measure that model's rounding noise.

Example::

    >>> import torch
    >>> reference_loss("mse")(torch.ones(2, 3), torch.zeros(2, 3)).item()
    1.0
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ort_lightning.artifacts.manifest import TensorSpec
from ort_lightning.export.verify.forward_mode import Kinks, ReferenceMode, without_dropout

__all__ = ["Call", "Reference", "batch_inputs", "labels_for", "reference_loss", "torch_reference"]

#: Loss name -> the torch function the onnxblock loss of the same name computes (mean reduction).
_TORCH_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "l1": F.l1_loss,
    "nll": F.nll_loss,
    "smooth_l1": F.smooth_l1_loss,
    "huber": F.huber_loss,
}
#: Batch size, and size of every other symbolic dimension, of random inputs (ONNX sources only).
NO_EXAMPLE_BATCH = 8

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Reference:
    """Torch autograd's loss and gradients for one batch, float32's distance from them (``noise``), ReLU ``kinks``."""

    loss: float
    #: float64 torch tensors, or numpy arrays read back from the forked child's files (`forked`).
    gradients: Mapping[str, torch.Tensor | np.ndarray]
    noise: dict[str, float] = field(default_factory=dict)
    kinks: dict[str, float] = field(default_factory=dict)
    loss_noise: float = 0.0
    ambiguous: int = 0


def reference_loss(loss: object) -> LossFn | None:
    """The torch loss that `loss` (an ``export_artifacts`` ``loss=``) computes, or None (a custom block)."""
    if isinstance(loss, str):
        return _TORCH_LOSSES.get(loss)
    if isinstance(loss, torch.nn.Module):
        return loss
    return None


def _size(dim: int | str, batch: int, first: bool) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    return batch if first or dim == "batch" else NO_EXAMPLE_BATCH


def _from_spec(spec: TensorSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    shape = tuple(_size(dim, batch, index == 0) for index, dim in enumerate(spec.shape))
    if spec.torch_dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(spec.torch_dtype)
    return torch.zeros(shape, dtype=spec.torch_dtype)


def _constant_rows(example: torch.Tensor) -> bool:
    """Whether a float example's rows are all alike (``torch.zeros(2, 4)``): no statistics to verify on."""
    return example.dtype.is_floating_point and example.dim() > 0 and bool((example == example[:1]).all())


def _resized(example: torch.Tensor, rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The example's `rows` (its batch axis resampled); a scalar stays as it is.

    NOTE: a float example of identical rows makes BatchNorm divide rounding noise by sqrt(eps); it
    is replaced by standard normal rows.
    """
    if example.dim() == 0:
        return example.clone()
    if _constant_rows(example):
        return torch.randn((len(rows), *example.shape[1:]), generator=generator).to(example.dtype)
    return example[rows % example.shape[0]].clone()


def batch_inputs(
    specs: Sequence[TensorSpec], examples: Sequence[torch.Tensor] | None, batch: int, *, seed: int
) -> list[torch.Tensor]:
    """Model inputs for one step at `batch`: the examples' rows when given, else random ones from the specs."""
    generator = torch.Generator().manual_seed(seed)
    if examples is None:
        return [_from_spec(spec, batch, generator) for spec in specs]
    rows = torch.arange(batch)
    return [_resized(example.detach().cpu(), rows, generator) for example in examples]


def labels_for(
    specs: Sequence[TensorSpec], output_shape: Sequence[int], batch: int, *, seed: int
) -> list[torch.Tensor]:
    """Labels for one step: class indices over the output's axis 1, or targets shaped like the output."""
    generator = torch.Generator().manual_seed(seed + 1)
    labels = []
    for spec in specs:
        if len(spec.shape) == len(output_shape) - 1 and not spec.torch_dtype.is_floating_point:
            classes = int(output_shape[1]) if len(output_shape) > 1 else 1
            shape = (output_shape[0], *output_shape[2:])
            labels.append(torch.randint(0, classes, shape, generator=generator).to(spec.torch_dtype))
        elif len(spec.shape) == len(output_shape):
            labels.append(torch.rand(tuple(output_shape), generator=generator).to(spec.torch_dtype))
        else:
            labels.append(_from_spec(spec, batch, generator))
    return labels


@dataclass(frozen=True)
class Call:
    """How the torch model is called (``keywords``) and which mapping ``output`` its loss reads."""

    keywords: tuple[str, ...] | None = None
    output: str | None = None


def _select(outputs: Any, call: Call, *, returns_loss: bool) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        key = call.output or ("loss" if returns_loss else "logits")
        return outputs[key] if key in outputs else next(iter(outputs.values()))
    return outputs[0]




def _training_copy(model: torch.nn.Module, trainable: Sequence[str], dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` in `dtype`, training mode, dropout off, training `trainable` only.

    NOTE: parameters are built straight in `dtype`; a plain deepcopy would copy every float32 weight first.
    """
    memo: dict[int, Any] = {
        id(parameter): torch.nn.Parameter(
            parameter.detach().to(dtype) if parameter.is_floating_point() else parameter.detach(), requires_grad=False
        )
        for parameter in model.parameters()
    }
    copied = without_dropout(copy.deepcopy(model, memo).to(dtype).train())
    wanted = set(trainable)
    for name, parameter in copied.named_parameters():
        parameter.requires_grad_(name in wanted)
        parameter.grad = None
    return copied


def model_output(
    model: torch.nn.Module, inputs: Sequence[torch.Tensor], call: Call, *, returns_loss: bool
) -> torch.Tensor:
    """The output the loss reads (the loss itself when `returns_loss`) for `inputs`, with autograd on."""
    outputs = model(**dict(zip(call.keywords, inputs, strict=True))) if call.keywords else model(*inputs)
    return _select(outputs, call, returns_loss=returns_loss)


def _cast(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return tensor.to(device, dtype) if tensor.dtype.is_floating_point else tensor.to(device)


class _Pass:
    """One forward of the reference copy in `dtype`, whose backward may run more than once."""

    def __init__(self, model: torch.nn.Module, trainable: Sequence[str], dtype: torch.dtype) -> None:
        self.model = _training_copy(model, trainable, dtype)
        self.dtype = dtype
        self.device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.trainable = trainable

    def output(self, inputs: Sequence[torch.Tensor], call: Call, *, returns_loss: bool) -> torch.Tensor:
        cast = [_cast(t, self.dtype, self.device) for t in inputs]
        return model_output(self.model, cast, call, returns_loss=returns_loss)

    def loss(self, output: torch.Tensor, labels: Sequence[torch.Tensor], loss_fn: LossFn | None) -> torch.Tensor:
        if loss_fn is None:
            return output
        if isinstance(loss_fn, torch.nn.Module):
            # NOTE: a loss module's class weights are float32 buffers; they follow the pass's dtype.
            loss_fn = copy.deepcopy(loss_fn).to(self.device, self.dtype)
        return loss_fn(output, *(_cast(label, self.dtype, self.device) for label in labels))

    def gradients(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        parameters = dict(self.model.named_parameters())
        wanted = [parameters[name] for name in self.trainable]
        grads = torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True)
        return {
            name: (torch.zeros_like(p) if g is None else g.detach()).cpu().to(torch.float64)
            for name, p, g in zip(self.trainable, wanted, grads, strict=True)
        }


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def torch_reference(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    label_specs: Sequence[TensorSpec],
    loss_fn: LossFn | None,
    *,
    call: Call,
    trainable: Sequence[str],
    seed: int,
) -> tuple[Reference, list[torch.Tensor]]:
    """Run one step in torch: float64 loss and gradients of `trainable`, their float32 noise, and the labels."""
    single, double, kinks = _Pass(model, trainable, torch.float32), _Pass(model, trainable, torch.float64), Kinks()
    returns_loss = loss_fn is None
    with ReferenceMode(kinks):
        output32 = single.output(inputs, call, returns_loss=returns_loss)
    labels = [] if returns_loss else labels_for(label_specs, tuple(output32.shape), inputs[0].shape[0], seed=seed)
    loss32 = single.loss(output32, labels, loss_fn)
    grads32 = single.gradients(loss32)
    # NOTE: the float32 pass's activations go before the float64 pass builds its own.
    value32 = float(loss32.detach())
    del output32, loss32
    with ReferenceMode(kinks, replay=True):
        output64 = double.output(inputs, call, returns_loss=returns_loss)
    loss64 = double.loss(output64, labels, loss_fn)
    grads64 = double.gradients(loss64)
    spread = {name: 0.0 for name in trainable}
    if kinks.ambiguous:
        kinks.side = -1
        low = double.gradients(loss64)
        kinks.side = 1
        high = double.gradients(loss64)
        spread = {name: _max_abs(high[name], low[name]) for name in trainable}
    reference = Reference(
        float(loss64.detach()),
        grads64,
        noise={name: _max_abs(grads32[name], grads64[name]) for name in trainable},
        kinks=spread,
        loss_noise=abs(value32 - float(loss64.detach())),
        ambiguous=kinks.ambiguous,
    )
    return reference, labels
