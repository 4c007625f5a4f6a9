"""Language models and Hugging Face transformers: export, train under a Trainer, match torch at step 1.

Tiny models built from configs with random weights (no downloads). Dropout is off so that one
step of ORT and one of torch autograd see the same function; padded positions carry token 0
and attention_mask 0, as a tokenizer writes them. The Hugging Face models are verified at export
too and run in the full run only (``slow``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ort_lightning import export_artifacts
from ort_lightning.errors import ExportError
from tests.step_reference import assert_gradients_close, ort_steps, torch_step

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, CLASSES = 40, 4, 8, 3
STEPS = 12


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids in [1, VOCAB) and an attention mask; the last positions of two rows are padding (id 0)."""
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 5:], mask[2, 6:] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def _check_step_one(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    worst = assert_gradients_close(grads, reference, rtol=1e-3, atol=1e-6)
    assert worst < 1e-3


def _assert_falls(losses: list[float]) -> None:
    assert len(losses) == STEPS
    assert losses[-1] < 0.8 * losses[0], losses


# ----------------------------------------------------------------------------- LSTM language model
class LSTMLanguageModel(nn.Module):
    """Embedding -> LSTM -> Linear; logits (B, V, T), the class axis 1 that torch's cross-entropy reads."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden).permute(0, 2, 1)


def test_lstm_language_model_with_ignore_index_padding(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, loss_fn = LSTMLanguageModel(), nn.CrossEntropyLoss(ignore_index=-100)
    ids, mask = _tokens()
    labels = torch.roll(ids, -1, dims=1).masked_fill(torch.roll(mask, -1, dims=1) == 0, -100)
    labels[:, -1] = -100
    # NOTE: tests/export/test_verify_zoo.py verifies an LSTM language model; this test compares with torch itself.
    artifacts = export_artifacts(model, torch.zeros(2, SEQ, dtype=torch.long), tmp_path, loss=loss_fn, verify=False)
    assert artifacts.manifest.loss_options["ignore_index"] == -100
    losses, grads, _ = ort_steps(artifacts, (ids, labels), steps=STEPS, lr=2e-2)
    expected, reference = torch_step(model, lambda m: loss_fn(m(ids), labels))
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    _check_step_one(grads, reference)
    _assert_falls(losses)


# ----------------------------------------------------------------------------- BERT / DistilBERT
def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES,
    )
    return transformers.BertForSequenceClassification(config)


def _distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=16, dropout=0.0,
        attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=CLASSES,
    )
    return transformers.DistilBertForSequenceClassification(config)


@pytest.mark.slow  # the largest models here; verified end to end
@pytest.mark.parametrize("build", [_bert, _distilbert], ids=["bert", "distilbert"])
def test_sequence_classifier_from_keyword_inputs(build: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, loss_fn = build(), nn.CrossEntropyLoss()
    ids, mask = _tokens()
    labels = torch.tensor([0, 1, 2, 1])
    example = {"input_ids": ids[:2], "attention_mask": mask[:2]}
    artifacts = export_artifacts(model, example, tmp_path, loss=loss_fn, output="logits")
    assert [spec.name for spec in artifacts.manifest.inputs] == ["input_ids", "attention_mask"]
    assert [spec.name for spec in artifacts.manifest.labels] == ["labels"]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    losses, grads, module = ort_steps(artifacts, batch, steps=STEPS, lr=1e-2)
    expected, reference = torch_step(model, lambda m: loss_fn(m(input_ids=ids, attention_mask=mask).logits, labels))
    assert sorted(name for name, _ in module.named_parameters()) == sorted(name for name, _ in model.named_parameters())
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    _check_step_one(grads, reference)
    _assert_falls(losses)


# ----------------------------------------------------------------------------- GPT-2, its own loss
def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_gpt2_trains_on_its_own_loss_with_tied_weights_as_one_parameter(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    ids, mask = _tokens()
    labels = ids.masked_fill(mask == 0, -100)
    example = {"input_ids": ids[:2], "attention_mask": mask[:2], "labels": labels[:2]}
    artifacts = export_artifacts(model, example, tmp_path, loss=None)
    assert artifacts.manifest.outputs == ("logits",)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied in torch ...
    pristine = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    losses, grads, module = ort_steps(artifacts, batch, steps=STEPS, lr=1e-2)
    # ... and one parameter under torch's name in ORT, whose step-1 gradient sums both uses.
    ort_names = sorted(name for name, _ in module.named_parameters())
    assert ort_names == sorted(pristine)
    assert "lm_head.weight" not in ort_names
    expected, reference = torch_step(model, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    _check_step_one(grads, reference)
    _assert_falls(losses)


def test_exported_parameters_are_the_models_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    ids, mask = _tokens()
    # NOTE: values only; tests/export/test_verify_zoo.py verifies GPT-2's step.
    artifacts = export_artifacts(
        model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, tmp_path, loss=None, verify=False
    )
    from ort_lightning import ORTLightningModule

    exported = dict(ORTLightningModule(artifacts).named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(exported[name], parameter.detach(), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss": "cross_entropy", "output": "logits"},
         r"Output 'logits' has shape \['batch', .*, 40\], like a language model's \(B, T, V\) logits over input "
         r"'input_ids'.*logits\.view\(-1, 40\)"),
        ({"loss": "cross_entropy", "output": "hidden"},
         r"GPT2LMHeadModel returns outputs \['logits', '[a-z_]+'\], but output='hidden' is not among them"),
        ({"loss": None}, r"loss=None trains on the model's own loss, but GPT2LMHeadModel returns \['logits', "
                         r"'[a-z_]+'\] without 'loss'; put the labels among example_inputs"),
        ({"loss": "cross_entropy", "input_names": ["ids", "mask"]},
         r"`input_names` \['ids', 'mask'\] disagree with the keys of the example_inputs dict"),
    ],
    ids=["lm-logits-unflattened", "unknown-output", "no-labels-for-own-loss", "input-names-vs-dict"],
)
def test_keyword_model_mistakes_are_explained(options: dict[str, Any], message: str, tmp_path: Path) -> None:
    ids, mask = _tokens()
    with pytest.raises(ExportError, match=message):
        export_artifacts(_gpt2(), {"input_ids": ids, "attention_mask": mask}, tmp_path, **options)


def test_output_on_a_model_without_named_outputs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"output='logits' picks an output by name, but Linear returns Tensor"):
        export_artifacts(nn.Linear(4, 3), torch.zeros(2, 4), tmp_path, output="logits")


@pytest.mark.slow
def test_gpt2_with_attention_dropout_trains(tmp_path: Path) -> None:
    # The attention dropout inside scaled_dot_product_attention is exported without its mask output,
    # which ORT's Dropout gradient needs; export_artifacts adds it.
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, attn_pdrop=0.1,
                                     resid_pdrop=0.1, embd_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    ids, mask = _tokens()
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    artifacts = export_artifacts(transformers.GPT2LMHeadModel(config), batch, tmp_path, loss=None)
    losses, _, _ = ort_steps(artifacts, batch, steps=STEPS, lr=1e-2)
    _assert_falls(losses)


def test_a_non_tensor_keyword_input_is_refused(tmp_path: Path) -> None:
    ids, _ = _tokens()
    message = r"every value of the example_inputs dict to be a tensor, but \['use_cache'\]"
    with pytest.raises(ExportError, match=message):
        export_artifacts(_gpt2(), {"input_ids": ids, "use_cache": False}, tmp_path)


@pytest.mark.slow
def test_bert_padding_row_gets_no_gradient_even_when_attended(tmp_path: Path) -> None:
    # nn.Embedding(padding_idx=0): torch gives the pad row no gradient; the graph has no padding_idx.
    torch.manual_seed(0)
    model, loss_fn = _bert(), nn.CrossEntropyLoss()
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    ids[:, 3] = 0
    mask, labels = torch.ones(BATCH, SEQ, dtype=torch.long), torch.tensor([0, 1, 2, 1])
    artifacts = export_artifacts(model, {"input_ids": ids, "attention_mask": mask}, tmp_path, loss=loss_fn)
    _, grads, _ = ort_steps(artifacts, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    _, reference = torch_step(model, lambda m: loss_fn(m(input_ids=ids, attention_mask=mask).logits, labels))
    assert torch.count_nonzero(grads["bert.embeddings.word_embeddings.weight"][0]) == 0
    _check_step_one(grads, reference)
