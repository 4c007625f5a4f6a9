"""transformers' encoder-decoders, vision and audio models at their defaults: export, train, match torch at step 1.

Tiny models built from their config classes (no downloads), dropout 0, exported at their default
attention: T5 and BART on their own loss, ViT, ConvNeXt and Whisper's encoder with a classifier
on a separate cross-entropy. Each step-1 loss and gradient is compared with plain torch autograd
(1e-3 relative), so the exports skip verification.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ort_lightning import export_artifacts
from tests.helpers import tiered
from tests.step_reference import assert_gradients_close, ort_steps, torch_step

transformers = pytest.importorskip("transformers")

BATCH, CLASSES = 4, 3


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    ))


def _bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2,
    ))


def _vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES,
    ))


def _convnext() -> nn.Module:
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, patch_size=2, image_size=16,
        drop_path_rate=0.0, num_labels=CLASSES,
    ))


def _whisper() -> nn.Module:
    return transformers.WhisperForAudioClassification(transformers.WhisperConfig(
        num_mel_bins=8, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, decoder_layers=1,
        decoder_attention_heads=4, decoder_ffn_dim=64, max_source_positions=8, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, vocab_size=100, num_labels=CLASSES,
    ))


def _tokens(generator: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(3, 100, (BATCH, 8), generator=generator),
            "labels": torch.randint(3, 100, (BATCH, 6), generator=generator)}


@dataclass(frozen=True)
class Model:
    """A model, its inputs from a generator, and whether it trains on its own loss (``labels`` among the inputs)."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]
    own_loss: bool = False


MODELS = [
    Model("t5", _t5, _tokens, own_loss=True),
    Model("bart", _bart, _tokens, own_loss=True),
    Model("vit", _vit, lambda g: {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}),
    Model("convnext", _convnext, lambda g: {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g)}),
    # Whisper's encoder (80 mel bins in the real model, 8 here) with a classifier over its pooled states.
    Model("whisper-encoder", _whisper, lambda g: {"input_features": torch.randn(BATCH, 8, 16, generator=g)}),
]


@pytest.mark.parametrize("case", tiered(MODELS, ids=[m.name for m in MODELS], fast={"vit"}))
def test_model_trains_equal_to_torch_at_step_one(case: Model, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = case.build().train()
    inputs = case.inputs(torch.Generator().manual_seed(0))
    example = {key: value[:2] for key, value in inputs.items()}
    compute: Callable[[nn.Module], torch.Tensor]
    if case.own_loss:
        artifacts = export_artifacts(model, example, tmp_path, loss=None, verify=False)
        batch: dict[str, Any] = inputs

        def compute(m: nn.Module) -> torch.Tensor:
            return m(**inputs).loss
    else:
        labels, loss_fn = torch.tensor([0, 1, 2, 1]), nn.CrossEntropyLoss()
        artifacts = export_artifacts(model, example, tmp_path, loss=loss_fn, output="logits", verify=False)
        batch = {**inputs, "labels": labels}

        def compute(m: nn.Module) -> torch.Tensor:
            return loss_fn(m(**inputs).logits, labels)
    losses, grads, _ = ort_steps(artifacts, batch)
    expected, reference = torch_step(model, compute)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert assert_gradients_close(grads, reference, rtol=1e-3, atol=1e-6) < 1e-3
