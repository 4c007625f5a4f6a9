"""Attention dropout trains in ORT as in torch: the exporter's Dropout without a training mode is switched on."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import lightning as L
import onnx
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule, export_artifacts
from tests.helpers import quiet_trainer

DRAWS = 64


class Attention(nn.Module):
    """Self-attention whose only randomness is the attention dropout (``nn.MultiheadAttention(dropout=...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed, _ = self.attention(x, x, x, need_weights=False)
        return self.head(mixed.mean(dim=1))


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Any, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = Attention()
    batch = (torch.randn(4, 6, 8), torch.tensor([0, 1, 2, 1]))
    # NOTE: unverified here; tests/export/test_verify_zoo.py verifies nn.MultiheadAttention(dropout=0.1) at ratio 0.
    artifacts = export_artifacts(model, batch[0], tmp_path_factory.mktemp("attention"), optimizer="sgd", verify=False)
    return model, artifacts, batch


def test_every_dropout_of_the_training_graph_trains(case: Any) -> None:
    _, artifacts, _ = case
    graph = onnx.load(artifacts.training_model).graph
    dropouts = [node for node in graph.node if node.op_type == "Dropout"]
    assert dropouts
    assert all(len(node.input) == 3 for node in dropouts), [list(node.input) for node in dropouts]


def test_attention_dropout_draws_as_torch_does(case: Any) -> None:
    """ORT's training losses under dropout have torch's mean, and differ from the eval graph's loss.

    Before the fix the attention Dropout ran as an identity: every training loss equalled the
    eval loss, with no spread at all.
    """
    model, artifacts, batch = case
    # NOTE: a learning rate of 1e-12 leaves the weights as they are: each step is one more draw.
    module = ORTLightningModule(artifacts, lr=1e-12, lr_scheduler="constant")
    eval_loss = float(module.evaluate_batch(batch)[0])
    capture = _Losses()
    quiet_trainer(max_steps=DRAWS, callbacks=[capture]).fit(module, DataLoader([batch] * DRAWS, batch_size=None))
    reference = copy.deepcopy(model).train()
    generator_seed = torch.initial_seed()
    torch.manual_seed(1)
    with torch.no_grad():
        torch_losses = [float(nn.functional.cross_entropy(reference(batch[0]), batch[1])) for _ in range(DRAWS)]
    torch.manual_seed(generator_seed)
    ort_losses = capture.losses
    assert statistics.pstdev(ort_losses) > 0.01 * statistics.pstdev(torch_losses)
    assert any(abs(loss - eval_loss) > 1e-4 for loss in ort_losses)
    spread = (statistics.variance(ort_losses) / DRAWS + statistics.variance(torch_losses) / DRAWS) ** 0.5
    assert abs(statistics.mean(ort_losses) - statistics.mean(torch_losses)) < 4 * spread
