"""Llama-family decoders at transformers' default attention: export, train under a Trainer, match torch.

Every family of `tests.decoders` is exported twice, as users feed it:

- **own loss, no mask**: ``input_ids`` and ``labels`` only, as packed causal-LM batches come
  (transformers then calls SDPA with ``enable_gqa=True``, which the package's symbolic converts);
- **separate loss, with a mask**: ``input_ids`` and a padded ``attention_mask``, the logits flattened
  to ``(B*T, V)`` for a cross-entropy over next tokens, padded on the left for some families and on
  the right for the others.

Each is compared with plain torch autograd: the step-1 gradients within 1e-3 relative, and, for a
few representative families, the parameters after 10 AdamW steps at lr 1e-3 within 1e-4 of
``torch.optim.AdamW`` (or 3x torch's own float32 noise, if larger). The comparison is the test's
own, so exports skip verification (``verify=False``), except one grouped-query model whose
verification child must convert the same attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ort_lightning import export_artifacts
from tests.decoders import FAMILIES, VOCAB, decoder, token_batch
from tests.helpers import tiered
from tests.step_reference import (
    assert_gradients_close,
    assert_parameters_close,
    ort_steps,
    torch_adamw_steps,
    torch_step,
)

transformers = pytest.importorskip("transformers")

#: Families whose parameters are compared after 10 AdamW steps (the others at step 1).
TEN_STEPS = {"mistral-sliding", "gemma2", "olmo2", "gpt-neox"}
#: Families padded on the left in the masked case (the others on the right).
LEFT_PADDED = {"llama", "qwen3", "mistral-sliding", "gemma", "olmo2"}
#: What the fast tier runs of each case (the tied Qwen2 variant below adds a 10-step check).
FAST_OWN, FAST_SEPARATE = {"llama"}, {"llama", "gemma2"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


class NextTokenLogits(nn.Module):
    """The decoder's logits flattened to ``(B*T, V)``, the rows a cross-entropy over next tokens reads."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits.reshape(-1, VOCAB)


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each position's label is the next token (-100 past the end and on padding), flattened."""
    shifted = torch.roll(labels, -1, dims=1)
    shifted[:, -1] = -100
    return shifted.reshape(-1)


def _check(artifacts: Any, model: nn.Module, batch: dict[str, torch.Tensor], loss: Any, *, steps: int) -> None:
    """Step-1 loss and gradients against torch autograd; after `steps` > 1, the parameters against torch's AdamW."""
    losses, grads, module = ort_steps(artifacts, batch, steps=steps, lr=1e-3)
    expected, reference = torch_step(model, loss)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    worst = assert_gradients_close(grads, reference, rtol=1e-3, atol=1e-6)
    assert worst < 1e-3
    if steps > 1:
        trained = torch_adamw_steps(model, loss, steps=steps, lr=1e-3)
        assert_parameters_close(dict(module.named_parameters()), trained, atol=1e-4)


def _own_loss(model: nn.Module, tmp_path: Path, *, steps: int, verify: bool = False) -> None:
    """Case A: ``input_ids`` + ``labels``, no mask, the model's own loss."""
    batch = {key: value for key, value in token_batch().items() if key != "attention_mask"}
    example = {key: value[:2] for key, value in batch.items()}
    artifacts = export_artifacts(model, example, tmp_path, loss=None, verify=verify)
    _check(artifacts, model, batch, lambda m: m(**batch).loss, steps=steps)


@pytest.mark.parametrize("family", tiered(FAMILIES, ids=FAMILIES, fast=FAST_OWN))
def test_family_trains_on_its_own_loss_without_a_mask(family: str, tmp_path: Path) -> None:
    _own_loss(decoder(family), tmp_path, steps=10 if family in TEN_STEPS else 1)


@pytest.mark.parametrize("family", tiered(FAMILIES, ids=FAMILIES, fast=FAST_SEPARATE))
def test_family_trains_on_a_separate_loss_with_padding(family: str, tmp_path: Path) -> None:
    model = NextTokenLogits(decoder(family))
    tokens = token_batch(padding="left" if family in LEFT_PADDED else "right")
    inputs = {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}
    labels, loss_fn = _next_tokens(tokens["labels"]), nn.CrossEntropyLoss()
    artifacts = export_artifacts(model, {k: v[:2] for k, v in inputs.items()}, tmp_path, loss=loss_fn, verify=False)
    _check(artifacts, model, {**inputs, "labels": labels}, lambda m: loss_fn(m(**inputs), labels), steps=1)


@dataclass(frozen=True)
class Variant:
    """A Llama-family decoder beside the families' defaults."""

    id: str
    family: str
    options: dict[str, Any]
    steps: int = 1
    verify: bool = False


VARIANTS = [
    # One key/value head for 4 query heads, verified at export: the child converts the same attention.
    Variant("kv1-verified", "llama", {"kv_heads": 1}, verify=True),
    Variant("kv4", "llama", {"kv_heads": 4}),
    # SmolLM/Qwen: one embedding matrix in and out, one parameter in ORT whose update sums both uses.
    Variant("tied", "qwen2", {"tied": True}, steps=10),
    # What fine-tuning scripts set: transformers then traces its packed-sequence check (diff, cumsum).
    Variant("no-cache", "llama", {"use_cache": False}),
]


@pytest.mark.parametrize("variant", tiered(VARIANTS, ids=[v.id for v in VARIANTS], fast={"tied"}))
def test_grouped_heads_tied_embeddings_and_no_cache(variant: Variant, tmp_path: Path) -> None:
    _own_loss(decoder(variant.family, **variant.options), tmp_path, steps=variant.steps, verify=variant.verify)
