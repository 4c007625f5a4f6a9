"""Model zoo: real architectures (built here from torch.nn, tiny) export, train under a Trainer and match torch.

Each model needs a legalization rewrite to train at all (LayerNormalization's outputs, HardSwish,
HardSigmoid, GroupNorm, AveragePool under a dynamic batch). Every one is exported at batch 4 and
trained at batch 8; the first step's gradients (read off ORT's gradient buffers before the update)
must be within 1e-3 relative of torch autograd on the same batch, and the loss must fall.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts
from tests.helpers import GradientProbe, quiet_trainer, tiered

EXAMPLE_BATCH, TRAIN_BATCH, CLASSES = 4, 8, 3


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


def _torch_gradients(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    *inputs, labels = batch
    F.cross_entropy(model(*inputs), labels).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


#: What the fast tier runs; the full run trains every model. Each export is verified too: the one step that the
#: verifier compares with torch at 1e-4 beside this test's 1e-3 after a Trainer's first step.
FAST = {"mobilenetv3-block-hardswish-se", "transformer-encoder-padding-mask"}


@pytest.mark.parametrize("zoo", tiered(ZOO, ids=[z.name for z in ZOO], fast=FAST))
def test_zoo_model_trains_and_matches_torch(tmp_path: Path, zoo: Zoo) -> None:
    torch.manual_seed(0)
    model = zoo.build()
    reference = copy.deepcopy(model).train()
    artifacts = export_artifacts(model, zoo.inputs(EXAMPLE_BATCH, 99), tmp_path / zoo.name)
    inputs = zoo.inputs(32, 0)
    labels = torch.randint(0, CLASSES, (32,), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(*inputs, labels), batch_size=TRAIN_BATCH, shuffle=False)
    probe = GradientProbe()
    trainer = quiet_trainer(max_epochs=8, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(ORTLightningModule(artifacts, lr=1e-2), loader)

    expected = _torch_gradients(reference, next(iter(loader)))
    assert set(probe.grads) == set(expected)
    for name, grad in expected.items():
        scale = max(float(grad.abs().max()), 1e-3 * max(float(g.abs().max()) for g in expected.values()))
        assert float((probe.grads[name] - grad).abs().max()) <= 1e-3 * scale, name
    first_epoch, last_epoch = probe.losses[:4], probe.losses[-4:]
    assert sum(last_epoch) < 0.85 * sum(first_epoch), probe.losses
