"""The benchmarked models and their data: generated tensors, nothing downloads.

Two kinds of case: classifiers of one input whose logits the artifacts' cross-entropy takes
(the MLPs and the small CNN), and models that take their labels and return the loss
themselves (exported with ``loss=None``): the transformer encoder with padding masks, the
GPT-2-like language model (logits flattened to ``(B*T, V)``), the ResNet-like CNN and the LSTM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

Data = Callable[[int, torch.Generator], tuple[torch.Tensor, ...]]

VOCAB, WIDTH, HEADS, FFN, LAYERS = 1000, 128, 2, 512, 2  # BERT-tiny's shape (2 layers, 128 wide, 2 heads)


def small_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def compute_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions and a linear head on 1x28x28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.fc = torch.nn.Linear(16 * 14 * 14, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.flatten(1))


def _encoder_layers(causal: bool) -> torch.nn.TransformerEncoder:
    layer = torch.nn.TransformerEncoderLayer(
        WIDTH, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=causal
    )
    return torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


class BertTiny(torch.nn.Module):
    """BERT-tiny-like encoder: token + position embeddings, 2 post-norm layers, a 2-class head on token 0.

    ``padding`` marks padded positions (True), which attention ignores.
    """

    def __init__(self, length: int = 128) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Parameter(0.02 * torch.randn(1, length, WIDTH))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.encoder = _encoder_layers(causal=False)
        self.head = torch.nn.Linear(WIDTH, 2)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(self.tokens(ids) + self.positions)
        hidden = self.encoder(hidden, src_key_padding_mask=padding)
        return F.cross_entropy(self.head(hidden[:, 0]), labels)


class GPT2Tiny(torch.nn.Module):
    """GPT-2-tiny-like language model: pre-norm causal layers, next-token loss over ``(B*T, V)``."""

    def __init__(self, length: int = 128) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Parameter(0.02 * torch.randn(1, length, WIDTH))
        self.decoder = _encoder_layers(causal=True)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.decoder(self.tokens(ids) + self.positions, mask=self.mask)
        logits = self.head(self.norm(hidden))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _Block(torch.nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(outputs)
        self.conv2 = torch.nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(outputs)
        self.shortcut = torch.nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = torch.nn.Sequential(
                torch.nn.Conv2d(inputs, outputs, 1, stride, bias=False), torch.nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNetTiny(torch.nn.Module):
    """ResNet-like CNN on 3x32x32 images: a stem, three basic blocks (16, 32, 64 channels), global mean pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU()
        )
        self.blocks = torch.nn.Sequential(_Block(16, 16, 1), _Block(16, 32, 2), _Block(32, 64, 2))
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # NOTE: a mean over H and W, not AdaptiveAvgPool2d: ORT's AveragePool gradient needs a
        # static batch dimension.
        return F.cross_entropy(self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3))), labels)


class LSTMClassifier(torch.nn.Module):
    """Embedding -> one-layer LSTM (128 units) -> 2-class head on the last step's output."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, 64)
        self.lstm = torch.nn.LSTM(64, 128, batch_first=True)
        self.head = torch.nn.Linear(128, 2)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        outputs, _ = self.lstm(self.tokens(ids))
        return F.cross_entropy(self.head(outputs[:, -1]), labels)


def images(shape: tuple[int, ...], classes: int = 10) -> Data:
    def data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, *shape, generator=generator), torch.randint(0, classes, (n,), generator=generator)

    return data


def _padded_tokens(length: int) -> Data:
    def data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, VOCAB, (n, length), generator=generator)
        lengths = torch.randint(length // 4, length + 1, (n,), generator=generator)
        padding = torch.arange(length) >= lengths[:, None]
        return ids, padding, torch.randint(0, 2, (n,), generator=generator)

    return data


def _next_tokens(length: int) -> Data:
    def data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, VOCAB, (n, length + 1), generator=generator)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return data


def _tokens(length: int, classes: int) -> Data:
    def data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, VOCAB, (n, length), generator=generator)
        return ids, torch.randint(0, classes, (n,), generator=generator)

    return data


@dataclass(frozen=True)
class Case:
    """One benchmarked model: how to build it, its data and its batch size.

    `returns_loss`: the model takes its labels last and returns the loss (exported with
    ``loss=None``); otherwise it returns logits for the artifacts' cross-entropy.
    """

    name: str
    factory: Callable[[], torch.nn.Module]
    data: Data
    batch_size: int
    returns_loss: bool = False
    counts_flops: bool = True  # torch's FlopCounterMode has no formula for some ops (LSTM)

    def model(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.factory()

    def example(self) -> tuple[torch.Tensor, ...]:
        """Two samples: the model inputs (and the labels, for a model that returns its loss)."""
        tensors = self.data(2, torch.Generator().manual_seed(1))
        return tensors if self.returns_loss else tensors[:-1]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The training loss of `batch` in plain torch."""
        if self.returns_loss:
            return model(*batch)
        return F.cross_entropy(model(*batch[:-1]), batch[-1])

    def loader(self, steps: int, seed: int = 0) -> DataLoader:
        """A DataLoader of exactly `steps` batches of generated inputs and labels."""
        tensors = self.data(steps * self.batch_size, torch.Generator().manual_seed(seed))
        return DataLoader(TensorDataset(*tensors), batch_size=self.batch_size, shuffle=False)

    def train_flops(self) -> float:
        """Forward + backward FLOPs of one batch, counted by torch's FlopCounterMode (0: not countable)."""
        if not self.counts_flops:
            return 0.0
        model = self.model()
        batch = self.data(self.batch_size, torch.Generator().manual_seed(2))
        counter = FlopCounterMode(display=False)
        with counter:
            self.loss(model, batch).backward()
        return float(counter.get_total_flops())


CASES = {
    "mlp-small": Case("mlp-small", small_mlp, images((784,)), 64),
    "mlp-compute": Case("mlp-compute", compute_mlp, images((784,)), 256),
    "cnn-small": Case("cnn-small", SmallCNN, images((1, 28, 28)), 64),
    "bert-tiny": Case("bert-tiny", BertTiny, _padded_tokens(128), 16, returns_loss=True),
    "gpt2-tiny": Case("gpt2-tiny", GPT2Tiny, _next_tokens(128), 8, returns_loss=True),
    "resnet-tiny": Case("resnet-tiny", ResNetTiny, images((3, 32, 32)), 32, returns_loss=True),
    "lstm": Case("lstm", LSTMClassifier, _tokens(64, 2), 32, returns_loss=True, counts_flops=False),
}
