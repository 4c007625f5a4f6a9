"""What an evaluation reports: a classifier's loss and accuracy per sample, a language model's per token.

An eval graph whose logits have one axis more than its labels beyond the batch (``(B, T, V)``
against ``(B, T)``) predicts every token: its batch loss is a mean over the tokens it predicts, so
batches are weighted by those, and the perplexity is ``exp`` of the mean. A causal LM predicts
each labelled token (not ``-100``, transformers' ignored index) after the first of its row; a token
classifier's first token ([CLS]) carries no label either. Accuracy, an argmax over axis 1, means
nothing there and is left out. A classifier's batches are weighted by their samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ort_lightning.errors import ConfigurationError

__all__ = ["IGNORE_INDEX", "Scores", "per_token"]

#: The label transformers' losses (and torch's cross-entropy) ignore.
IGNORE_INDEX = -100


def per_token(logits: np.ndarray | None, labels: np.ndarray) -> bool:
    """Whether `logits` score every token of `labels` (a language model's ``(B, T, V)`` against ``(B, T)``)."""
    return logits is not None and labels.ndim >= 2 and logits.ndim == labels.ndim + 1


@dataclass
class Scores:
    """Per-batch ``(loss, logits, labels)`` added up (`add`), then the means (`result`)."""

    loss: float = 0.0
    correct: float = 0.0
    examples: int = 0
    tokens: int = 0
    token_level: bool = False

    def add(self, loss: float, logits: np.ndarray | None, labels: np.ndarray) -> None:
        """Add one batch: its mean `loss`, weighted by its samples, or by its labelled tokens for a language model."""
        self.token_level = per_token(logits, labels)
        self.examples += int(labels.shape[0])
        if self.token_level:
            count = int((labels[:, 1:] != IGNORE_INDEX).sum())
            self.tokens += count
            self.loss += loss * count
            return
        self.loss += loss * labels.shape[0]
        if logits is not None:
            self.correct += float((logits.argmax(axis=1) == labels).sum())

    def result(self) -> dict[str, float]:
        """``loss``, ``accuracy``, ``examples``; a language model's ``perplexity`` and ``tokens`` for ``accuracy``.

        Raises:
            ConfigurationError: for empty data.
        """
        if not self.examples or (self.token_level and not self.tokens):
            raise ConfigurationError("The evaluation data is empty; give every evaluating device at least one sample.")
        if self.token_level:
            mean = self.loss / self.tokens
            return {"loss": mean, "perplexity": math.exp(mean), "tokens": self.tokens, "examples": self.examples}
        return {"loss": self.loss / self.examples, "accuracy": self.correct / self.examples, "examples": self.examples}
