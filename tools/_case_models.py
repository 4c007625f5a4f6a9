"""The small torch modules the op audit's cases are built from (see `tools.cases`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SDPA", "Attention", "Bag", "DecoderLayer", "EncoderLayer", "First", "Fn", "Interpolate", "Pre"]


class Fn(nn.Module):
    """``fn(linear(x))``: a parameterized input to a functional op (or a parameter-free layer)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], features: int = 6, out: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(features, out)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.linear(x))


class Pre(nn.Module):
    """``layer(conv1x1(x))`` for 1-, 2- or 3-d inputs: gives parameter-free layers a parameter to train."""

    def __init__(self, layer: nn.Module, dims: int, channels: int = 3, *, bias: bool = True) -> None:
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        self.conv = conv(channels, channels, 1, bias=bias)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.conv(x))


class First(nn.Module):
    """The first output of a layer that returns a tuple (RNNs, MultiheadAttention)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


class Attention(nn.Module):
    """MultiheadAttention (self-attention) with an optional key padding mask input."""

    def __init__(self, *, batch_first: bool = True) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first)

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return self.attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]


class SDPA(nn.Module):
    """``F.scaled_dot_product_attention`` over projected q, k, v, with a mask input or ``is_causal``."""

    def __init__(self, *, causal: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.causal = causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return out.transpose(1, 2).flatten(2)


class GroupedSDPA(nn.Module):
    """Grouped-query attention as transformers' decoders call it (``enable_gqa=True``).

    4 query heads, `kv_heads` key/value heads, with a mask input or ``is_causal``.
    """

    def __init__(self, *, kv_heads: int, causal: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.kv = nn.Linear(8, 2 * 2 * kv_heads)
        self.kv_heads, self.causal = kv_heads, causal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (4, 2)).transpose(1, 2)
        k, v = self.kv(x).unflatten(-1, (2, self.kv_heads, 2)).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=True)
        return out.transpose(1, 2).flatten(2)


class EncoderLayer(nn.Module):
    # NOTE: called with its mask by keyword, as models do; a bare layer(x) trips torch's exporter
    # (its `is_causal` argument is traced as a tensor).
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.layer(x, src_key_padding_mask=padding)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.layer(x, x),)


class Bag(nn.Module):
    """EmbeddingBag over fixed-length bags (a 2-d index input)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.bag(tokens)


class Interpolate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=(6, 5), mode="nearest")
