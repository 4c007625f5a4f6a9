"""A federated LoRA fine-tune of a small Llama, for examples/fleet_lora.yaml (nothing downloads).

The text comes from a small probabilistic grammar: ten topics, each with its own nouns, verbs and
adjectives, drawn with Zipf weights, in sentence templates. Generic text (any topic's word in any
slot, the generic templates) pre-trains the base; each device then holds one topic's text, whose
sentences also repeat their subject ("..., then the N ...": a copy that only attention can make),
and the server measures the global model on held-out text of every topic. `Tokenizer` is a
word-level tokenizer over the grammar's words. `lora_llama` builds the model from transformers'
``LlamaConfig`` (random weights), pre-trains it with plain torch and wraps it in peft LoRA;
`TopicText` is the data module whose training set is the devices' text, topic after topic.
"""

from __future__ import annotations

import random
import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

FUNCTION_WORDS = ("the", "a", "and", "with", "near", "over", "then", "some", "every", "is", ".")
#: Words per topic and part of speech.
SIZES = {"n": 12, "v": 6, "j": 6}
#: Generic templates (pre-training and topics alike); N, V, J are a noun, a verb, an adjective.
GENERIC = (
    "the J N V the N .", "a N V near the J N .", "the N and the N V .", "some N V with a N .", "every J N V .",
)
#: Templates of the topics' text only: the subject comes back (``N1``), as a copy of the context.
COPYING = ("the N1 V the N , then the N1 V .", "a J N1 V over the N and the N1 is J .")


def topic_words(topic: int) -> dict[str, list[str]]:
    """Topic `topic`'s nouns, verbs and adjectives (``t3n0``: topic 3's first noun)."""
    return {kind: [f"t{topic}{kind}{i}" for i in range(size)] for kind, size in SIZES.items()}


class Tokenizer:
    """Word-level ids over the grammar's words: ``<pad>``, ``<unk>``, the function words, then each topic's words."""

    def __init__(self, topics: int) -> None:
        words = ["<pad>", "<unk>", ",", *FUNCTION_WORDS]
        for topic in range(topics):
            words += [word for kind in SIZES for word in topic_words(topic)[kind]]
        self.words = words
        self.ids = {word: i for i, word in enumerate(words)}

    def encode(self, text: str) -> list[int]:
        """The ids of `text`'s words (split on spaces)."""
        return [self.ids.get(word, 1) for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        """The words of `ids`, joined by spaces."""
        return " ".join(self.words[i] for i in ids)


def sentence(rng: random.Random, topics: int, topic: int | None) -> str:
    """One sentence: of `topic` (its words, Zipf-weighted; generic or copying template), or generic (None)."""
    templates = GENERIC + (COPYING * 2 if topic is not None else ())
    template = rng.choice(templates)
    subject = None
    words = []
    for slot in template.split():
        kind = slot[0].lower()
        if slot in ("N", "V", "J", "N1"):
            if slot == "N1" and subject is not None:
                words.append(subject)
                continue
            choices = topic_words(rng.randrange(topics) if topic is None else topic)[kind]
            weights = [1.0 / (rank + 1) for rank in range(len(choices))] if topic is not None else None
            word = rng.choices(choices, weights=weights)[0]
            subject = word if slot == "N1" else subject
            words.append(word)
        else:
            words.append(slot)
    return " ".join(words)


def sequences(tokenizer: Tokenizer, count: int, length: int, *, topics: int, topic: int | None,
              seed: int) -> torch.Tensor:
    """`count` rows of `length` token ids cut from one stream of sentences (of `topic`, or generic)."""
    rng = random.Random(seed)
    stream: list[int] = []
    while len(stream) < count * length:
        stream += tokenizer.encode(sentence(rng, topics, topic))
    return torch.tensor(stream[:count * length], dtype=torch.int64).view(count, length)


class TopicText(L.LightningDataModule):
    """Each topic's text (``train`` rows, topic after topic) and held-out rows of every topic (validation).

    ``(input_ids, labels)`` pairs, the labels the ids themselves: the model shifts them, as a causal LM does.
    """

    def __init__(self, topics: int = 10, train: int = 48, held_out: int = 8, length: int = 32,
                 batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.topics, self.train, self.held_out, self.length = topics, train, held_out, length
        self.batch_size, self.seed = batch_size, seed

    def setup(self, stage: str | None = None) -> None:
        tokenizer = Tokenizer(self.topics)

        def rows(count: int, offset: int) -> torch.Tensor:
            return torch.cat([sequences(tokenizer, count, self.length, topics=self.topics, topic=topic,
                                        seed=self.seed * 1000 + offset + topic) for topic in range(self.topics)])

        train, held_out = rows(self.train, 0), rows(self.held_out, 500)
        self.sets = {"train": TensorDataset(train, train.clone()), "val": TensorDataset(held_out, held_out.clone())}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["train"], batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=64)


def pretrain(model: torch.nn.Module, *, topics: int, steps: int, length: int, batch_size: int, lr: float,
             seed: int) -> list[float]:
    """Train every weight of `model` on generic text of the grammar (plain torch, AdamW); the losses."""
    data = sequences(Tokenizer(topics), steps * batch_size, length, topics=topics, topic=None, seed=seed + 99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = data[step * batch_size:(step + 1) * batch_size]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def pretrained_llama(hidden: int = 256, layers: int = 4, intermediate: int = 1536, heads: int = 4, kv_heads: int = 2,
                     vocabulary: int = 512, topics: int = 10, pretrain_steps: int = 100, length: int = 32,
                     pretrain_batch: int = 8, pretrain_lr: float = 3e-3, seed: int = 0) -> torch.nn.Module:
    """A Llama from its config class (random weights from `seed`), pre-trained on generic text of the grammar."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=max(vocabulary, len(Tokenizer(topics).words)), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=length, attention_dropout=0.0, tie_word_embeddings=False, use_cache=False,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    started = time.perf_counter()
    losses = pretrain(model, topics=topics, steps=pretrain_steps, length=length, batch_size=pretrain_batch,
                      lr=pretrain_lr, seed=seed)
    parameters = sum(p.numel() for p in model.parameters())
    if losses:
        print(f"pre-trained a {parameters / 1e6:.1f} M parameter Llama for {pretrain_steps} steps in "
              f"{time.perf_counter() - started:.1f} s (loss {losses[0]:.3f} -> {losses[-1]:.3f})", flush=True)
    return model.eval()


def lora_llama(*, rank: int = 8, **base: Any) -> torch.nn.Module:
    """`pretrained_llama` (with the `base` options) wrapped in peft LoRA of `rank` on q_proj and v_proj."""
    import peft

    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(pretrained_llama(**base), lora)
