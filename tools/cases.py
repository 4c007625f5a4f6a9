"""The op audit's cases: one tiny model per differentiable torch.nn layer family and common tensor op.

The one list that ``python -m tools.op_audit`` (which writes docs/ops.md) and tests/export/test_ops.py
both run. Each case builds its model and makes inputs for any batch size, from fixed seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tools._case_models import (
    SDPA,
    Attention,
    Bag,
    DecoderLayer,
    EncoderLayer,
    First,
    Fn,
    GroupedSDPA,
    Interpolate,
    Pre,
)

__all__ = ["CASES", "REFUSED", "Case"]

Inputs = Callable[[int], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Case:
    """One audited layer: how to build it, its inputs at a batch size, and how it is compared."""

    id: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Inputs
    #: False for layers that draw random numbers in training (Dropout, RReLU): their gradients
    #: cannot be compared with torch's, so only the training step itself is checked.
    deterministic: bool = True


def _randn(*shape: int, scale: float = 2.0) -> Inputs:
    def make(batch: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(batch)
        return (torch.randn(batch, *shape, generator=generator) * scale,)

    return make


def _tokens(length: int, vocab: int = 10) -> Inputs:
    def make(batch: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(batch)
        return (torch.randint(0, vocab, (batch, length), generator=generator),)

    return make


def _spatial(dims: int, size: int = 6) -> tuple[int, ...]:
    return (3, *([size] * dims))


def _activation(name: str, layer: Callable[[], nn.Module], *, deterministic: bool = True) -> Case:
    return Case(
        f"act-{name}",
        "activation",
        lambda: nn.Sequential(nn.Linear(6, 8), layer()),
        _randn(6),
        deterministic=deterministic,
    )


_ACTIVATIONS = [
    _activation("elu", nn.ELU),
    _activation("hardshrink", nn.Hardshrink),
    _activation("hardsigmoid", nn.Hardsigmoid),
    _activation("hardtanh", nn.Hardtanh),
    _activation("hardswish", nn.Hardswish),
    _activation("leakyrelu", nn.LeakyReLU),
    _activation("logsigmoid", nn.LogSigmoid),
    _activation("prelu", nn.PReLU),
    _activation("relu", nn.ReLU),
    _activation("relu6", nn.ReLU6),
    _activation("rrelu", nn.RReLU, deterministic=False),
    _activation("selu", nn.SELU),
    _activation("celu", nn.CELU),
    _activation("gelu", nn.GELU),
    _activation("gelu-tanh", lambda: nn.GELU(approximate="tanh")),
    _activation("sigmoid", nn.Sigmoid),
    _activation("silu", nn.SiLU),
    _activation("mish", nn.Mish),
    _activation("softplus", nn.Softplus),
    _activation("softshrink", nn.Softshrink),
    _activation("softsign", nn.Softsign),
    _activation("tanh", nn.Tanh),
    _activation("tanhshrink", nn.Tanhshrink),
    _activation("threshold", lambda: nn.Threshold(0.1, 20.0)),
    _activation("glu", nn.GLU),
    _activation("softmin", lambda: nn.Softmin(dim=1)),
    _activation("softmax", lambda: nn.Softmax(dim=1)),
    _activation("logsoftmax", lambda: nn.LogSoftmax(dim=1)),
    Case("act-softmax2d", "activation", lambda: Pre(nn.Softmax2d(), 2), _randn(*_spatial(2))),
]

_NORMS = [
    Case("norm-batchnorm1d", "norm", lambda: Pre(nn.BatchNorm1d(3), 1, bias=False), _randn(*_spatial(1))),
    Case("norm-batchnorm2d", "norm", lambda: Pre(nn.BatchNorm2d(3), 2, bias=False), _randn(*_spatial(2))),
    Case("norm-batchnorm3d", "norm", lambda: Pre(nn.BatchNorm3d(3), 3, bias=False), _randn(*_spatial(3, 4))),
    Case("norm-groupnorm", "norm", lambda: Pre(nn.GroupNorm(1, 3), 2, bias=False), _randn(*_spatial(2))),
    Case(
        "norm-groupnorm-1d", "norm", lambda: nn.Sequential(nn.Conv1d(3, 6, 1), nn.GroupNorm(3, 6)), _randn(*_spatial(1))
    ),
    Case(
        "norm-instancenorm1d",
        "norm",
        lambda: Pre(nn.InstanceNorm1d(3, affine=True), 1, bias=False),
        _randn(*_spatial(1)),
    ),
    Case("norm-instancenorm2d", "norm", lambda: Pre(nn.InstanceNorm2d(3), 2, bias=False), _randn(*_spatial(2))),
    Case(
        "norm-instancenorm3d",
        "norm",
        lambda: Pre(nn.InstanceNorm3d(3, affine=True), 3, bias=False),
        _randn(*_spatial(3, 4)),
    ),
    Case("norm-layernorm", "norm", lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)), _randn(6)),
    Case(
        "norm-layernorm-no-bias", "norm", lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, bias=False)), _randn(6)
    ),
    Case("norm-layernorm-2d", "norm", lambda: Pre(nn.LayerNorm([6, 6]), 2, bias=False), _randn(*_spatial(2))),
    Case("norm-localresponse", "norm", lambda: Pre(nn.LocalResponseNorm(2), 2), _randn(*_spatial(2))),
    Case("norm-rmsnorm", "norm", lambda: nn.Sequential(nn.Linear(6, 8), nn.RMSNorm(8)), _randn(6)),
]


def _pool(name: str, dims: int, layer: Callable[[], nn.Module], size: int = 6) -> Case:
    return Case(f"pool-{name}", "pooling", lambda: Pre(layer(), dims), _randn(*_spatial(dims, size)))


_POOLS = [
    _pool("maxpool1d", 1, lambda: nn.MaxPool1d(2)),
    _pool("maxpool2d", 2, lambda: nn.MaxPool2d(3, 2, padding=1)),
    _pool("maxpool3d", 3, lambda: nn.MaxPool3d(2), 4),
    _pool("avgpool1d", 1, lambda: nn.AvgPool1d(2)),
    _pool("avgpool2d", 2, lambda: nn.AvgPool2d(2)),
    _pool("avgpool2d-pad-ceil", 2, lambda: nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False)),
    _pool("avgpool3d", 3, lambda: nn.AvgPool3d(2), 4),
    _pool("lppool1d", 1, lambda: nn.LPPool1d(2, 2)),
    _pool("lppool2d", 2, lambda: nn.LPPool2d(2, 2)),
    _pool("lppool3d", 3, lambda: nn.LPPool3d(2, 2), 4),
    _pool("adaptiveavg1d", 1, lambda: nn.AdaptiveAvgPool1d(3)),
    _pool("adaptiveavg2d", 2, lambda: nn.AdaptiveAvgPool2d(2)),
    _pool("adaptiveavg2d-global", 2, lambda: nn.AdaptiveAvgPool2d(1)),
    _pool("adaptiveavg3d", 3, lambda: nn.AdaptiveAvgPool3d(2), 4),
    _pool("adaptivemax1d", 1, lambda: nn.AdaptiveMaxPool1d(3)),
    _pool("adaptivemax2d", 2, lambda: nn.AdaptiveMaxPool2d(2)),
    _pool("adaptivemax3d", 3, lambda: nn.AdaptiveMaxPool3d(2), 4),
    _pool("fractionalmax2d", 2, lambda: nn.FractionalMaxPool2d(2, output_size=3)),
]


def _conv(name: str, dims: int, layer: Callable[[], nn.Module], channels: int = 4) -> Case:
    return Case(f"conv-{name}", "conv", layer, _randn(channels, *([6] * dims)))


_CONVS = [
    _conv("conv1d", 1, lambda: nn.Conv1d(4, 5, 3)),
    _conv("conv2d", 2, lambda: nn.Conv2d(4, 5, 3, padding=1)),
    _conv("conv3d", 3, lambda: nn.Conv3d(4, 2, 3)),
    _conv("conv2d-grouped", 2, lambda: nn.Conv2d(4, 6, 3, groups=2)),
    _conv("conv2d-depthwise", 2, lambda: nn.Conv2d(4, 4, 3, groups=4)),
    _conv("conv2d-dilated-strided", 2, lambda: nn.Conv2d(4, 5, 3, dilation=2, stride=2, padding=2)),
    _conv("conv2d-reflect", 2, lambda: nn.Conv2d(4, 5, 3, padding=1, padding_mode="reflect")),
    _conv("conv2d-circular", 2, lambda: nn.Conv2d(4, 5, 3, padding=1, padding_mode="circular")),
    _conv("convtranspose1d", 1, lambda: nn.ConvTranspose1d(4, 3, 3, stride=2)),
    _conv("convtranspose2d", 2, lambda: nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1)),
    _conv("convtranspose3d", 3, lambda: nn.ConvTranspose3d(4, 2, 2)),
    _conv("convtranspose2d-grouped", 2, lambda: nn.ConvTranspose2d(4, 4, 3, groups=2)),
    Case("conv-unfold", "conv", lambda: Pre(nn.Unfold(2, stride=2), 2), _randn(*_spatial(2))),
    Case("conv-fold", "conv", lambda: nn.Sequential(nn.Conv1d(12, 12, 1), nn.Fold((4, 4), 2, stride=2)), _randn(12, 4)),
]

_RECURRENT = [
    Case("rnn-tanh", "recurrent", lambda: First(nn.RNN(4, 5, batch_first=True)), _randn(3, 4)),
    Case(
        "rnn-relu-2layer",
        "recurrent",
        lambda: First(nn.RNN(4, 5, num_layers=2, nonlinearity="relu", batch_first=True)),
        _randn(3, 4),
    ),
    Case("lstm", "recurrent", lambda: First(nn.LSTM(4, 5, batch_first=True)), _randn(3, 4)),
    Case(
        "lstm-bidirectional",
        "recurrent",
        lambda: First(nn.LSTM(4, 5, batch_first=True, bidirectional=True)),
        _randn(3, 4),
    ),
    Case(
        "lstm-2layer-proj",
        "recurrent",
        lambda: First(nn.LSTM(4, 5, num_layers=2, proj_size=3, batch_first=True)),
        _randn(3, 4),
    ),
    Case("gru", "recurrent", lambda: First(nn.GRU(4, 5, batch_first=True)), _randn(3, 4)),
    Case(
        "gru-bidirectional",
        "recurrent",
        lambda: First(nn.GRU(4, 5, batch_first=True, bidirectional=True)),
        _randn(3, 4),
    ),
    Case("rnncell", "recurrent", lambda: nn.RNNCell(4, 5), _randn(4)),
    Case("lstmcell", "recurrent", lambda: First(nn.LSTMCell(4, 5)), _randn(4)),
    Case("grucell", "recurrent", lambda: nn.GRUCell(4, 5), _randn(4)),
]


def _with_padding(batch: int) -> tuple[torch.Tensor, ...]:
    (x,) = _randn(4, 8)(batch)
    padding = torch.zeros(batch, 4, dtype=torch.bool)
    padding[::2, -1] = True  # every other sequence has its last token padded
    return x, padding


def _with_float_mask(batch: int) -> tuple[torch.Tensor, ...]:
    (x,) = _randn(4, 8)(batch)
    mask = torch.zeros(batch, 1, 4, 4)
    mask[::2, :, :, -1] = float("-inf")
    return x, mask


def _with_bool_mask(batch: int) -> tuple[torch.Tensor, ...]:
    (x,) = _randn(4, 8)(batch)
    return x, torch.ones(batch, 1, 4, 4, dtype=torch.bool).tril()


def _with_empty_rows(batch: int) -> tuple[torch.Tensor, ...]:
    """A causal bool mask whose first query row attends to nothing in every other sample (left padding)."""
    (x,) = _randn(4, 8)(batch)
    mask = torch.ones(batch, 1, 4, 4, dtype=torch.bool).tril()
    mask[::2, :, :, 0] = False
    return x, mask


_ATTENTION = [
    Case("mha", "attention", lambda: Attention(), _randn(4, 8)),
    Case("mha-key-padding-mask", "attention", lambda: Attention(), _with_padding),
    Case("sdpa", "attention", lambda: SDPA(), _randn(4, 8)),
    Case("sdpa-causal", "attention", lambda: SDPA(causal=True), _randn(4, 8)),
    Case("sdpa-float-mask", "attention", lambda: SDPA(), _with_float_mask),
    Case("sdpa-bool-mask", "attention", lambda: SDPA(), _with_bool_mask),
    Case("sdpa-gqa", "attention", lambda: GroupedSDPA(kv_heads=2), _randn(4, 8)),
    Case("sdpa-gqa-causal", "attention", lambda: GroupedSDPA(kv_heads=1, causal=True), _randn(4, 8)),
    Case("sdpa-gqa-bool-mask", "attention", lambda: GroupedSDPA(kv_heads=2), _with_bool_mask),
    Case("sdpa-bool-mask-empty-rows", "attention", lambda: SDPA(), _with_empty_rows),
    Case("transformer-encoder-layer", "attention", lambda: EncoderLayer(), _with_padding),
    Case("transformer-decoder-layer", "attention", lambda: First(DecoderLayer()), _randn(4, 8)),
]


_SPARSE = [
    Case("embedding", "sparse", lambda: nn.Embedding(10, 4), _tokens(5)),
    Case("embedding-padding-idx", "sparse", lambda: nn.Embedding(10, 4, padding_idx=0), _tokens(5)),
    Case("embeddingbag-mean", "sparse", lambda: Bag("mean"), _tokens(5)),
    Case("embeddingbag-sum", "sparse", lambda: Bag("sum"), _tokens(5)),
    Case("embeddingbag-max", "sparse", lambda: Bag("max"), _tokens(5)),
]


def _vision(name: str, layer: Callable[[], nn.Module], channels: int = 3, dims: int = 2, size: int = 4) -> Case:
    return Case(f"vision-{name}", "vision", lambda: Pre(layer(), dims, channels), _randn(channels, *([size] * dims)))


_VISION = [
    _vision("upsample-nearest", lambda: nn.Upsample(scale_factor=2)),
    _vision("upsample-bilinear", lambda: nn.Upsample(scale_factor=2, mode="bilinear")),
    _vision("upsample-bilinear-align", lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)),
    _vision("upsample-bicubic", lambda: nn.Upsample(scale_factor=2, mode="bicubic")),
    _vision("upsample-linear-1d", lambda: nn.Upsample(scale_factor=2, mode="linear"), dims=1),
    _vision("upsample-trilinear", lambda: nn.Upsample(scale_factor=2, mode="trilinear"), dims=3),
    _vision("interpolate-size", lambda: Interpolate()),
    _vision("pixelshuffle", lambda: nn.PixelShuffle(2), channels=4),
    _vision("pixelunshuffle", lambda: nn.PixelUnshuffle(2)),
    _vision("channelshuffle", lambda: nn.ChannelShuffle(2), channels=4),
]


def _pad(name: str, dims: int, layer: Callable[[], nn.Module]) -> Case:
    return Case(f"pad-{name}", "padding", lambda: Pre(layer(), dims), _randn(*_spatial(dims, 4)))


_PADDING = [
    _pad(
        f"{kind}{dims}d",
        dims,
        lambda kind=kind, dims=dims: getattr(nn, f"{kind}Pad{dims}d")(*((1, 0.5) if kind == "Constant" else (1,))),
    )
    for kind in ("Reflection", "Replication", "Zero", "Constant", "Circular")
    for dims in (1, 2, 3)
]


def _dropout(name: str, dims: int, layer: Callable[[], nn.Module]) -> Case:
    return Case(
        f"dropout-{name}", "dropout", lambda: Pre(layer(), dims), _randn(*_spatial(dims, 4)), deterministic=False
    )


_DROPOUT = [
    _dropout("dropout", 1, lambda: nn.Dropout(0.5)),
    _dropout("dropout1d", 1, lambda: nn.Dropout1d(0.5)),
    _dropout("dropout2d", 2, lambda: nn.Dropout2d(0.5)),
    _dropout("dropout3d", 3, lambda: nn.Dropout3d(0.5)),
    _dropout("alphadropout", 1, lambda: nn.AlphaDropout(0.5)),
    _dropout("featurealphadropout", 2, lambda: nn.FeatureAlphaDropout(0.5)),
]

_INDEX = torch.tensor([3, 0, 7, 7])


def _op(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Case:
    return Case(f"op-{name}", "tensor op", lambda: Fn(fn), _randn(6))


_OPS = [
    _op("gather", lambda h: torch.gather(h, 1, _INDEX.expand(h.shape[0], 4))),
    _op("index-select", lambda h: h.index_select(1, _INDEX)),
    _op("advanced-index", lambda h: h[:, _INDEX]),
    _op("slice-step", lambda h: h[:, 1::2]),
    _op("masked-fill", lambda h: h.masked_fill(h > 0.5, -1.0)),
    _op("where", lambda h: torch.where(h > 0, h * h, -h)),
    _op("cumsum", lambda h: h.cumsum(1)),
    _op("cumsum-bool", lambda h: h * (h > 0).cumsum(1)),
    _op("diff", lambda h: torch.diff(h, dim=1, prepend=h[:, :1])),
    _op("prod", lambda h: h.prod(1, keepdim=True)),
    _op("atan", torch.atan),
    _op("einsum", lambda h: torch.einsum("bi,bj->bij", h, h).flatten(1)),
    _op("matmul", lambda h: h.unflatten(1, (2, 4)) @ h.unflatten(1, (4, 2))),
    _op("cat-split-chunk", lambda h: torch.cat([*h.split(3, 1)[::-1], *h.chunk(2, 1)], 1)),
    _op("expand", lambda h: h[:, None, :].expand(-1, 3, -1) * 2),
    _op("tril-triu", lambda h: (h[:, :, None] * h[:, None, :]).tril() - (h[:, :, None] * h[:, None, :]).triu(1)),
    _op("max-min", lambda h: torch.stack([h.max(1).values, h.min(1).values], 1)),
    _op("topk", lambda h: h.topk(3, 1).values),
    _op("norm-std-var", lambda h: torch.stack([h.norm(dim=1), h.std(1), h.var(1)], 1)),
    _op("clamp-pow-exp-log", lambda h: h.clamp(-1, 1).pow(3) + h.exp().add(1).log()),
    _op("flip-roll", lambda h: h.flip(1) + h.roll(2, 1)),
    _op("cosine-similarity", lambda h: F.cosine_similarity(h[:, :4], h[:, 4:]).unsqueeze(1)),
    _op("pairwise-distance", lambda h: F.pairwise_distance(h[:, :4], h[:, 4:]).unsqueeze(1)),
    Case("op-bilinear", "tensor op", lambda: nn.Bilinear(6, 6, 3), lambda b: (*_randn(6)(b),) * 2),
    Case("op-linear-3d", "tensor op", lambda: nn.Linear(6, 3), _randn(4, 6)),
]

#: Every audited case, in the order docs/ops.md lists them.
CASES: list[Case] = [
    *_ACTIVATIONS,
    *_NORMS,
    *_POOLS,
    *_CONVS,
    *_RECURRENT,
    *_ATTENTION,
    *_SPARSE,
    *_VISION,
    *_PADDING,
    *_DROPOUT,
    *_OPS,
]

#: The cases that still do not train, each with the `ExportError` it gets (a regex of its message).
REFUSED: dict[str, str] = {
    # nn.LocalResponseNorm on 4-d input exports a data-dependent If; ORT's gradient builder aborts on it.
    "norm-localresponse": r"'If' .* is control flow on the gradient path",
    # torch's exporter has no symbolic for these at opset 17 (col2im needs 18, which ORT 1.19.2 cannot train).
    "pool-fractionalmax2d": r"no conversion of aten::fractional_max_pool2d at opset 17, called in module 'layer'",
    "conv-fold": r"no conversion of aten::col2im at opset 17, called in module '1' \(Fold\)",
    "lstm-2layer-proj": r"no conversion of aten::lstm .*LSTMs with projections",
    # nn.EmbeddingBag exports a Loop over the bags.
    "embeddingbag-mean": r"'Loop' .*torch module 'bag'.* is control flow",
    "embeddingbag-sum": r"'Loop' .*torch module 'bag'.* is control flow",
    "embeddingbag-max": r"'Loop' .*torch module 'bag'.* is control flow",
    # ONNX Atan and ReduceProd have no gradient in ORT 1.19.2 and no exact rewrite here yet.
    # Random in training, and ORT's eval graph would stay random (it turns off Dropout only):
    # AlphaDropout's training formula cannot become an identity there, RReLU would keep sampling.
    "dropout-alphadropout": r"no conversion of aten::alpha_dropout .*'layer' \(AlphaDropout\).*training mode",
    "dropout-featurealphadropout": r"no conversion of aten::feature_alpha_dropout .*training mode",
    "act-rrelu": r"cannot convert Sequential: aten::rrelu, called in module '1' \(RReLU\): nn.RReLU samples its "
                 r"negative slopes in training.*use nn.LeakyReLU",
    "op-atan": r"no gradient for the ONNX op 'Atan'",
    "op-prod": r"no gradient for the ONNX op 'ReduceProd'",
}
