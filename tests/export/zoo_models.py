"""The model zoo: real architectures built here from torch.nn, tiny, each with the inputs it takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 3


class TextEncoder(nn.Module):
    """Embedding -> 2-layer nn.TransformerEncoder with a padding mask -> masked mean -> classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).float()
        return self.head((hidden * keep).sum(1) / keep.sum(1))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce, self.expand = nn.Conv2d(channels, 4, 1), nn.Conv2d(4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(self.pool(x)))))


class MobileBlock(nn.Module):
    """MobileNetV3-like: stem, inverted residual with depthwise conv, HardSwish and squeeze-excitation."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.Hardswish())
        self.expand = nn.Sequential(nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16),
                                       nn.Hardswish())
        self.se = SqueezeExcite(16)
        self.project = nn.Sequential(nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = x + self.project(self.se(self.depthwise(self.expand(x))))
        return self.head(x.mean((2, 3)))


class SignalCNN(nn.Module):
    """1-d CNN: Conv1d -> GroupNorm -> GELU -> Conv1d -> LayerNorm over channels -> max over time -> classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv1d(2, 32, 5, padding=2), nn.GroupNorm(4, 32)
        self.conv2, self.norm2 = nn.Conv1d(32, 32, 3, padding=1), nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.conv1(x)))
        x = self.norm2(self.conv2(x).transpose(1, 2))
        return self.head(x.amax(1))


class ResidualNet(nn.Module):
    """ResNet-like: stem, one basic block, AvgPool2d, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Linear(8 * 4 * 4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        return self.head(self.pool(x).flatten(1))


class PatchViT(nn.Module):
    """ViT-like: 4x4 patches, class token, position embedding, pre-norm encoder layer, LayerNorm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.position = nn.Parameter(torch.randn(1, 5, 16) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True,
                                                  norm_first=True)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), patches], 1) + self.position
        return self.head(self.norm(self.encoder(tokens))[:, 0])


def _images(n: int, seed: int, size: int = 8) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed)),)


def _signals(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n, 2, 16, generator=torch.Generator().manual_seed(seed)),)


def _texts(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 20, (n, 6), generator=generator)
    lengths = torch.randint(3, 7, (n,), generator=generator)
    padding = torch.arange(6)[None, :] >= lengths[:, None]
    return tokens.masked_fill(padding, 0), padding


@dataclass(frozen=True)
class Zoo:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int], tuple[torch.Tensor, ...]]


ZOO = [
    Zoo("transformer-encoder-padding-mask", TextEncoder, _texts),
    Zoo("mobilenetv3-block-hardswish-se", MobileBlock, lambda n, seed: _images(n, seed, 16)),
    Zoo("cnn1d-groupnorm-layernorm", SignalCNN, _signals),
    Zoo("resnet-avgpool-other-batch", ResidualNet, _images),
    Zoo("vit-patches", PatchViT, _images),
]
