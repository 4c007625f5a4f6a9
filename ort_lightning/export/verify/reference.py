"""The torch side of export-time verification: inputs, labels and torch autograd's loss and gradients.

Inputs for a batch size are made from the example inputs (floats drawn at random, integers
tiled from the example, so token ids and labels stay valid) or, for ONNX sources, from the
graph's input specs. Labels follow the training graph: integer labels are class indices in
``[0, C)`` with ``C`` the size of the output's axis 1, floating targets are shaped like the
output, drawn in ``[0, 1)`` (valid for every built-in loss, BCE included).

The reference runs a copy of the model in training mode (BatchNorm on batch statistics, as in
the training graph) with dropout off (``nn.Dropout`` and ``F.dropout`` alike); the graph's
Dropout ratios are set to 0 on the ORT side, so both sides compute the same deterministic step.

Example::

    >>> import torch
    >>> reference_loss("mse")(torch.ones(2, 3), torch.zeros(2, 3)).item()
    1.0
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ort_lightning.artifacts.manifest import TensorSpec

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
#: Position of ``dropout_p`` in ``F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p)``.
_SDPA_DROPOUT_ARG = 4
#: Functions a torch forward drops out with; the graph's Dropout nodes run at ratio 0 instead.
_DROPOUTS = frozenset(
    {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout}
)
#: Size given to a symbolic dimension other than the batch (ONNX sources only).
_OTHER_DIM = 3

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Reference:
    """Torch autograd's loss and the gradient of every trainable parameter, for one batch."""

    loss: float
    gradients: dict[str, torch.Tensor]


def reference_loss(loss: object) -> LossFn | None:
    """Return the torch loss that `loss` (an ``export_artifacts`` ``loss=``) computes, or None if unknown.

    A torch loss module (``nn.CrossEntropyLoss(ignore_index=-100)``) is its own reference; a
    custom ``onnxblock.Block`` has none. ``loss=None`` (the model returns its loss) is handled by
    `torch_reference` itself.
    """
    if isinstance(loss, str):
        return _TORCH_LOSSES.get(loss)
    if isinstance(loss, torch.nn.Module):
        return loss
    return None


def _size(dim: int | str, batch: int, first: bool) -> int:
    if isinstance(dim, int) and dim > 0:
        return dim
    return batch if first or dim == "batch" else _OTHER_DIM


def _from_spec(spec: TensorSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    shape = tuple(_size(dim, batch, index == 0) for index, dim in enumerate(spec.shape))
    if spec.torch_dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(spec.torch_dtype)
    return torch.zeros(shape, dtype=spec.torch_dtype)


def _resized(example: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    if example.dim() == 0:
        return example.clone()
    if example.dtype.is_floating_point:
        return torch.randn((batch, *example.shape[1:]), generator=generator).to(example.dtype)
    # NOTE: integers are ids, masks or labels whose valid range only the example knows.
    return example[torch.arange(batch) % example.shape[0]].clone()


def batch_inputs(
    specs: Sequence[TensorSpec], examples: Sequence[torch.Tensor] | None, batch: int, *, seed: int
) -> list[torch.Tensor]:
    """Model inputs for one step at `batch`: from the examples when given, else from the specs."""
    generator = torch.Generator().manual_seed(seed)
    if examples is None:
        return [_from_spec(spec, batch, generator) for spec in specs]
    return [_resized(example.detach().cpu(), batch, generator) for example in examples]


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
    """How the torch model is called and which of its outputs the loss reads.

    ``keywords``: the forward takes keyword tensors in this order (dict example inputs).
    ``output``: the key of a mapping output (a Hugging Face ``ModelOutput``) the loss reads; by
    default ``"loss"`` when the model returns its loss, else ``"logits"``, else the first value.
    """

    keywords: tuple[str, ...] | None = None
    output: str | None = None


def _select(outputs: Any, call: Call, *, returns_loss: bool) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        key = call.output or ("loss" if returns_loss else "logits")
        return outputs[key] if key in outputs else next(iter(outputs.values()))
    return outputs[0]


class _WithoutDropout(TorchFunctionMode):
    """Dropout functions return their input: ``nn.Dropout`` modules and ``F.dropout`` calls alike.

    ``F.scaled_dot_product_attention`` drops out inside the function (Hugging Face attention passes
    ``dropout_p``); it runs with ``dropout_p=0``, as the graph's Dropout after its Softmax does.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > _SDPA_DROPOUT_ARG:
                args = (*args[:_SDPA_DROPOUT_ARG], 0.0, *args[_SDPA_DROPOUT_ARG + 1 :])
            kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        return func(*args, **kwargs)


def _training_copy(model: torch.nn.Module, trainable: Sequence[str]) -> torch.nn.Module:
    copied = copy.deepcopy(model).train()
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
    """Run one step in torch: loss and gradients of `trainable`, and the labels it used.

    `loss_fn` None means the model's first output is the loss (``export_artifacts(loss=None)``).
    """
    copied = _training_copy(model, trainable)
    # NOTE: the reference runs where the model lives (a CUDA model stays there); inputs, labels and
    # gradients travel on the CPU, where the verification child runs ORT.
    device = next((parameter.device for parameter in copied.parameters()), torch.device("cpu"))
    with _WithoutDropout():
        output = model_output(copied, [t.to(device) for t in inputs], call, returns_loss=loss_fn is None)
    if loss_fn is None:
        labels: list[torch.Tensor] = []
        loss = output
    else:
        labels = labels_for(label_specs, tuple(output.shape), inputs[0].shape[0], seed=seed)
        loss = loss_fn(output, *(label.to(device) for label in labels))
    loss.backward()
    parameters = dict(copied.named_parameters())
    gradients = {}
    for name in trainable:
        grad = parameters[name].grad
        gradients[name] = torch.zeros_like(parameters[name]) if grad is None else grad.detach()
        gradients[name] = gradients[name].cpu().clone()
    return Reference(float(loss.detach()), gradients), labels
