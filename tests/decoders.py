"""Tiny decoders of transformers' Llama family, built from their config classes (no downloads).

Every builder returns the family's ``*ForCausalLM`` at transformers' *default* attention
implementation (SDPA for most, eager with soft-capping for Gemma 2), with random weights drawn
from a seed, dropout 0, 2 layers, hidden size 64, 4 query heads and ``kv_heads`` key/value heads
(grouped-query attention when fewer than 4). ``token_batch`` writes causal-LM batches as a tokenizer
and a collator do, with or without padding. The export, LoRA and write-back tests share them.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES: tuple[str, ...] = (
    "llama", "qwen2", "qwen3", "mistral", "mistral-sliding", "phi3", "gemma", "gemma2", "olmo2", "gpt-neox",
)

VOCAB = 100
HIDDEN = 64
HEADS = 4
LAYERS = 2
INTERMEDIATE = 128
PAD = 0

__all__ = ["FAMILIES", "HEADS", "PAD", "VOCAB", "decoder", "token_batch"]

# The config class, the model class and what each family needs beyond the shared shape.
_FAMILY: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"attention_dropout": 0.0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"attention_dropout": 0.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"attention_dropout": 0.0, "head_dim": HIDDEN // HEADS}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"attention_dropout": 0.0, "sliding_window": None}),
    # NOTE: a window of 4 under sequences of 8 makes transformers build a mask tensor (no enable_gqa).
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"attention_dropout": 0.0, "sliding_window": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"attention_dropout": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                               "pad_token_id": PAD}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"attention_dropout": 0.0, "head_dim": HIDDEN // HEADS}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attention_dropout": 0.0, "head_dim": HIDDEN // HEADS,
                                                     "query_pre_attn_scalar": HIDDEN // HEADS, "sliding_window": 4}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"attention_dropout": 0.0}),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"attention_dropout": 0.0, "hidden_dropout": 0.0,
                                                        "classifier_dropout": 0.0}),
}


def decoder(family: str, *, kv_heads: int = 2, tied: bool = False, seed: int = 0,
            **config_overrides: Any) -> Any:
    """A tiny ``*ForCausalLM`` of `family` at transformers' default attention, random weights from `seed`.

    GPT-NeoX has no grouped-query attention: its `kv_heads` is ignored (4, one per query head).

    Args:
        family: one of ``FAMILIES``.
        kv_heads: key/value heads (1, 2 or 4 against 4 query heads).
        tied: tie the input and output embeddings, as SmolLM and small Qwen models do.
        seed: the seed of the random weights.
        **config_overrides: passed to the config class last (e.g. ``attn_implementation="eager"``).

    Returns:
        The model, in training mode.

    Raises:
        ValueError: for a family not in ``FAMILIES``.
    """
    import transformers

    if family not in _FAMILY:
        raise ValueError(f"unknown decoder family {family!r}; expected one of {FAMILIES}")
    config_name, model_name, extra = _FAMILY[family]
    options: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "max_position_embeddings": 64,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, **extra,
    }
    if family != "gpt-neox":
        options["num_key_value_heads"] = kv_heads
    options.update(config_overrides)
    config = getattr(transformers, config_name)(**options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return model.train()


def token_batch(*, batch: int = 4, seq: int = 8, padding: str = "none", seed: int = 0) -> dict[str, torch.Tensor]:
    """A causal-LM batch: ``input_ids`` in ``[3, VOCAB)``, ``attention_mask``, ``labels`` (the ids, -100 on padding).

    Args:
        batch: rows.
        seq: tokens per row.
        padding: ``"none"``, or ``"left"`` / ``"right"``: rows 0 and 2 (of at least 3) padded by 3 and 2
            positions on that side with pad id 0, attention mask 0 and label -100 there.
        seed: the seed of the token ids.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, each ``(batch, seq)`` int64.

    Raises:
        ValueError: for another `padding`.
    """
    if padding not in ("none", "left", "right"):
        raise ValueError(f"padding must be 'none', 'left' or 'right', got {padding!r}")
    ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padding != "none":
        for row, count in ((0, 3), (2, 2)):
            if row < batch:
                span = slice(0, count) if padding == "left" else slice(seq - count, seq)
                mask[row, span] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
