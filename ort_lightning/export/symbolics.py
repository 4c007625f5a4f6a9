"""ONNX symbolics for torch layers the TorchScript exporter refuses at opset 17 (or in training mode).

Each writes the layer in ops ORT 1.19.2 can differentiate, registered for one export only
(`registered`), so a user's own ``torch.onnx.export`` sees torch unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.onnx import symbolic_helper, symbolic_opset11, symbolic_opset14

__all__ = ["SYMBOLICS", "Conversion", "registered"]

_OPSET = 17


def _const(g: Any, value: Any, dtype: torch.dtype = torch.float32) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _rms_norm(g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any) -> Any:
    """``x / sqrt(mean(x^2 over the normalized dims) + eps) * weight``."""
    dims = symbolic_helper._maybe_get_const(normalized_shape, "is")
    epsilon = symbolic_helper._maybe_get_const(eps, "f")
    if epsilon is None or symbolic_helper._is_none(eps):
        epsilon = torch.finfo(torch.float32).eps
    axes = list(range(-len(dims), 0))
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=axes, keepdims_i=1)
    normed = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, _const(g, float(epsilon)))))
    return normed if symbolic_helper._is_none(weight) else g.op("Mul", normed, weight)


@symbolic_helper.parse_args("v", "f", "f")
def _threshold(g: Any, x: Any, threshold: float, value: float) -> Any:
    """``where(x > threshold, x, value)`` (torch's exporter takes only threshold 0)."""
    return g.op("Where", g.op("Greater", x, _const(g, threshold)), x, _const(g, value))


def _bilinear(g: Any, x1: Any, x2: Any, weight: Any, bias: Any) -> Any:
    """``y[..., o] = x1 W[o] x2 + b[o]`` as one MatMul, a product and a sum."""
    out, left, right = symbolic_helper._get_tensor_sizes(weight)
    flat = g.op("Reshape", g.op("Transpose", weight, perm_i=[1, 0, 2]), _const(g, [left, out * right], torch.int64))
    mixed = g.op("MatMul", x1, flat)
    lead = g.op("Slice", g.op("Shape", x1), _const(g, [0], torch.int64), _const(g, [-1], torch.int64))
    split = g.op("Concat", lead, _const(g, [out, right], torch.int64), axis_i=0)
    products = g.op("Mul", g.op("Reshape", mixed, split), g.op("Unsqueeze", x2, _const(g, [-2], torch.int64)))
    summed = g.op("ReduceSum", products, _const(g, [-1], torch.int64), keepdims_i=0)
    return summed if symbolic_helper._is_none(bias) else g.op("Add", summed, bias)


@symbolic_helper.parse_args("v", "i")
def _channel_shuffle(g: Any, x: Any, groups: int) -> Any:
    """(N, C, ...) -> (N, g, C/g, rest) -> swap the group axes -> back to x's shape."""
    channels = int(symbolic_helper._get_tensor_sizes(x)[1] or 0)
    grouped = g.op("Reshape", x, _const(g, [0, groups, channels // groups, -1], torch.int64))
    swapped = g.op("Transpose", grouped, perm_i=[0, 2, 1, 3])
    return g.op("Reshape", swapped, g.op("Shape", x))


def _keep_mask(g: Any, x: Any, p: float, *, per_channel: bool) -> Any:
    """ONNX Dropout of ones (ORT's kernel, with its seed): ``keep / (1 - p)``, per element or per (N, C)."""
    if per_channel:
        rank = int(symbolic_helper._get_tensor_rank(x) or 2)
        lead = g.op("Slice", g.op("Shape", x), _const(g, [0], torch.int64), _const(g, [2], torch.int64))
        shape = g.op("Concat", lead, _const(g, [1] * (rank - 2), torch.int64), axis_i=0)
    else:
        shape = g.op("Shape", x)
    ones = g.op("ConstantOfShape", shape, value_t=torch.tensor([1.0]))
    scaled, _ = g.op("Dropout", ones, _const(g, p), _const(g, True, torch.bool), outputs=2)
    return scaled


def _feature_dropout(g: Any, x: Any, p: Any, train: Any) -> Any:
    """nn.Dropout1d/2d/3d: one keep/drop draw per (sample, channel)."""
    rate, training = symbolic_helper._maybe_get_const(p, "f"), symbolic_helper._maybe_get_const(train, "b")
    if not training or not rate:
        return x
    return g.op("Mul", x, _keep_mask(g, x, float(rate), per_channel=True))


def _rrelu(g: Any, x: Any, lower: Any, upper: Any, training: Any, generator: Any) -> Any:
    """Refuse nn.RReLU in training: its eval graph would keep sampling slopes (ORT turns off Dropout only)."""
    raise RuntimeError(
        "nn.RReLU samples its negative slopes in training, and ONNX Runtime's eval graph would keep sampling "
        "them instead of using (lower + upper) / 2; use nn.LeakyReLU((lower + upper) / 2) or nn.PReLU"
    )


def _repeat_heads(g: Any, x: Any, query: Any) -> Any:
    """(B, H_kv, S, D) -> (B, H_q, S, D), each key/value head repeated in a row, as transformers' ``repeat_kv``."""
    shape, heads = g.op("Shape", x), g.op("Shape", query)
    one, two, four = (_const(g, [n], torch.int64) for n in (1, 2, 4))
    group = g.op("Div", g.op("Slice", heads, one, two), g.op("Slice", shape, one, two))
    expand_to = g.op("Concat", _const(g, [1, 1], torch.int64), group, _const(g, [1, 1], torch.int64), axis_i=0)
    grouped = g.op("Expand", g.op("Unsqueeze", x, two), expand_to)
    target = g.op("Concat", g.op("Slice", heads, _const(g, [0], torch.int64), two),
                  g.op("Slice", shape, two, four), axis_i=0)
    repeated = g.op("Reshape", grouped, target)
    sizes = symbolic_helper._get_tensor_sizes(x)
    query_sizes = symbolic_helper._get_tensor_sizes(query)
    if sizes is not None and query_sizes is not None and len(sizes) == 4:
        repeated.setType(x.type().with_sizes([sizes[0], query_sizes[1], sizes[2], sizes[3]]))
    return repeated


def _safe_mask(g: Any, attn_mask: Any, query: Any) -> tuple[Any, Any]:
    """A bool mask as an additive mask (0 or the lowest finite value), and 0 for rows attending nowhere."""
    dtype = torch.onnx.JitScalarType.from_value(query)
    lowest = torch.finfo(dtype.dtype()).min
    additive = g.op("Where", attn_mask, _const(g, 0.0, dtype.dtype()), _const(g, lowest, dtype.dtype()))
    allowed = g.op("Cast", attn_mask, to_i=dtype.onnx_type())
    anywhere = g.op("ReduceMax", allowed, axes_i=[-1], keepdims_i=1)
    return additive, anywhere


@symbolic_helper.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def _scaled_dot_product_attention(g: Any, query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
                                  is_causal: bool, scale: Any, enable_gqa: bool) -> Any:
    """Torch's symbolic, with keys and values repeated per group (``enable_gqa``) and a differentiable bool mask.

    NOTE: torch 2.13's symbolic refuses ``enable_gqa``, which transformers asks for when it passes no
    mask. With a bool mask it adds -inf and zeroes the NaN of fully masked rows, whose Softmax
    gradient is NaN in ORT (left padding makes such rows); here the lowest finite value is added and
    those rows are multiplied by 0.
    """
    if enable_gqa:
        key, value = _repeat_heads(g, key, query), _repeat_heads(g, value, query)
    rows = None
    if not symbolic_helper._is_none(attn_mask) and symbolic_helper._is_bool(attn_mask):
        attn_mask, rows = _safe_mask(g, attn_mask, query)
    out = symbolic_opset14.scaled_dot_product_attention(
        g, query, key, value, attn_mask, dropout_p, is_causal, scale, False
    )
    return out if rows is None else g.op("Mul", out, rows)


@symbolic_helper.parse_args("v", "i", "i", "v", "v")
def _diff(g: Any, x: Any, n: int, dim: int, prepend: Any, append: Any) -> Any:
    """``torch.diff`` as Slice, Slice, Sub (transformers calls it on ``position_ids`` without a cache or mask)."""
    parts = [part for part in (prepend, x, append) if not symbolic_helper._is_none(part)]
    values = parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis_i=dim)
    axis = _const(g, [dim], torch.int64)
    for _ in range(n):
        later = g.op("Slice", values, _const(g, [1], torch.int64), _const(g, [2**62], torch.int64), axis)
        earlier = g.op("Slice", values, _const(g, [0], torch.int64), _const(g, [-1], torch.int64), axis)
        values = g.op("Sub", later, earlier)
    return values


@symbolic_helper.parse_args("v", "i", "none")
def _cumsum(g: Any, x: Any, dim: int, dtype: Any = None) -> Any:
    """``cumsum`` of a bool tensor counts in int64, as torch does (ONNX does not type ``CumSum`` on bool)."""
    if symbolic_helper._is_bool(x) and (dtype is None or symbolic_helper._is_none(dtype)):
        x = g.op("Cast", x, to_i=torch.onnx.TensorProtoDataType.INT64)
    return symbolic_opset11.cumsum(g, x, dim, dtype)


@dataclass(frozen=True)
class Conversion:
    """A symbolic the package registers for one aten op, and why torch's own does not do."""

    symbolic: Callable[..., Any]
    reason: str


#: aten op -> its conversion, registered for the exporter's opset while `torch_to_onnx` runs
#: (docs/ops.md lists them with their reasons).
SYMBOLICS: dict[str, Conversion] = {
    "aten::rms_norm": Conversion(_rms_norm, "no symbolic at opset 17 (nn.RMSNorm); becomes ReduceMean arithmetic"),
    "aten::threshold": Conversion(
        _threshold, "torch's symbolic takes threshold 0 only (nn.Threshold); becomes Where(x > threshold, x, value)"
    ),
    "aten::bilinear": Conversion(_bilinear, "no symbolic (nn.Bilinear); becomes one MatMul, a product and a sum"),
    "aten::channel_shuffle": Conversion(
        _channel_shuffle, "no symbolic (nn.ChannelShuffle); becomes Reshape/Transpose/Reshape"
    ),
    "aten::feature_dropout": Conversion(
        _feature_dropout, "torch's symbolic refuses training mode (nn.Dropout1d/2d/3d); becomes a per-channel "
        "Dropout mask"
    ),
    "aten::rrelu": Conversion(
        _rrelu, "ORT's eval graph would keep sampling its slopes (nn.RReLU in training): refused with the fix"
    ),
    "aten::scaled_dot_product_attention": Conversion(
        _scaled_dot_product_attention, "torch's symbolic refuses enable_gqa=True (grouped-query attention: "
        "transformers' Llama-family decoders at SDPA without a mask), and its bool mask gives a query row that may "
        "attend nowhere (left padding) a NaN Softmax gradient in ORT; keys and values become Unsqueeze/Expand/Reshape "
        "per group, a bool mask adds the lowest finite value and such rows are multiplied by 0, then torch's own "
        "symbolic"
    ),
    "aten::diff": Conversion(
        _diff, "no symbolic (transformers' packed-sequence check on position_ids under use_cache=False); becomes "
        "Slice, Slice, Sub"
    ),
    "aten::cumsum": Conversion(
        _cumsum, "torch's symbolic writes CumSum on a bool, which ONNX does not type; a bool is cast to int64 first"
    ),
}


@contextlib.contextmanager
def registered(opset: int = _OPSET) -> Iterator[None]:
    """Register `SYMBOLICS` for `opset` while the block runs; torch's own symbolics come back after."""
    for name, conversion in SYMBOLICS.items():
        torch.onnx.register_custom_op_symbolic(name, conversion.symbolic, opset)
    try:
        yield
    finally:
        for name in SYMBOLICS:
            torch.onnx.unregister_custom_op_symbolic(name, opset)
