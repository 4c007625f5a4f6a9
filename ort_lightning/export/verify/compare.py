"""Comparing one ORT training step with torch autograd: tolerances, the per-batch check, the messages.

A gradient passes when ``max|ort - torch| <= ATOL + RTOL * max|torch|``, per parameter: the
tolerance follows the scale of that parameter's gradient, not of the whole model. The loss passes
under the same rule with its own magnitude. The worst parameter is the one that uses the
largest share of its tolerance.

Example::

    >>> import numpy as np, torch
    >>> from ort_lightning.export.verify.reference import Reference
    >>> reference = Reference(1.0, {"w": torch.tensor([1.0, -2.0])})
    >>> compare(4, reference, 1.0, {"w": np.array([1.0, -2.0], dtype=np.float32)}, ["w"]).status
    'passed'
    >>> compare(4, reference, 1.0, {"w": np.array([1.0, -2.5], dtype=np.float32)}, ["w"]).worst_parameter
    'w'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ort_lightning.export.verify.reference import Reference

__all__ = ["ATOL", "RTOL", "BatchCheck", "compare", "mismatch_message"]

# NOTE: measured on MLPs (cross-entropy, mse, frozen layers, a model returning its own loss), a
# BatchNorm+Dropout CNN, a BatchNorm1d MLP (bce_with_logits, l1), an embedding LSTM and a GRU, at
# two batch sizes each (float32, CPU): gradients agree with torch to 4e-7 of their largest value,
# losses to 2.4e-7. Biases right before a BatchNorm have a true gradient of 0 and show rounding
# noise up to 6.7e-8 on both sides, which ATOL absorbs. Wrong graphs are off by 0.5 (one gradient
# scaled by 1.5) and 0.67 (a custom autograd.Function): RTOL 1e-3 leaves 2500x margin above the
# noise and 500x below the smallest error seen.
RTOL = 1e-3
ATOL = 1e-6


@dataclass(frozen=True)
class BatchCheck:
    """One batch size's verdict, as kept in the manifest.

    ``status`` is ``"passed"``, ``"mismatch"``, ``"non-finite"``, ``"missing gradient"`` or
    ``"no torch reference"`` (ONNX sources and custom loss blocks: only crashes, errors and
    non-finite values are checked).
    """

    batch_size: int
    status: str
    loss: float
    loss_diff: float | None = None
    worst_parameter: str | None = None
    grad_abs_diff: float | None = None
    grad_rel_diff: float | None = None
    #: ``grad_abs_diff / (ATOL + RTOL * max|torch gradient|)`` of the worst parameter: above 1 fails.
    tolerance_used: float | None = None

    def summary(self) -> str:
        """One line: status and the differences (the batch size is the caller's label)."""
        text = f"{self.status}, loss {self.loss:.6g}"
        if self.loss_diff is not None:
            text += f" (diff {self.loss_diff:.2g})"
        if self.worst_parameter is not None and self.grad_abs_diff is not None:
            text += (
                f", worst gradient {self.worst_parameter}: abs diff {self.grad_abs_diff:.2g}, "
                f"rel diff {self.grad_rel_diff:.2g}"
            )
            if self.tolerance_used is not None:
                text += f" ({self.tolerance_used:.0%} of its tolerance)"
        return text

    @classmethod
    def from_report(cls, entry: dict[str, Any]) -> BatchCheck:
        """Read one entry of a manifest's report, ignoring fields this version does not know."""
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in entry.items() if key in known})


def _within(diff: float, scale: float) -> float:
    """Share of the tolerance that `diff` uses (<= 1 passes)."""
    return diff / (ATOL + RTOL * scale)


def _nonfinite(loss: float, gradients: dict[str, np.ndarray], trainable: Sequence[str]) -> str | None:
    if not math.isfinite(loss):
        return "the loss"
    return next((name for name in trainable if not np.isfinite(gradients[name]).all()), None)


def compare(
    batch: int, reference: Reference | None, loss: float, gradients: dict[str, np.ndarray], trainable: Sequence[str]
) -> BatchCheck:
    """Compare ORT's loss and `gradients` at `batch` with torch's `reference` (None: no reference)."""
    missing = [name for name in trainable if name not in gradients]
    if missing:
        return BatchCheck(batch, "missing gradient", loss, worst_parameter=missing[0])
    bad = _nonfinite(loss, gradients, trainable)
    if bad is not None:
        return BatchCheck(batch, "non-finite", loss, worst_parameter=None if bad == "the loss" else bad)
    if reference is None:
        return BatchCheck(batch, "no torch reference", loss)
    loss_diff = abs(loss - reference.loss)
    worst, worst_share, worst_abs, worst_scale = None, -1.0, 0.0, 0.0
    for name in trainable:
        expected = reference.gradients[name].numpy().astype(np.float64)
        diff = float(np.max(np.abs(gradients[name].astype(np.float64) - expected), initial=0.0))
        scale = float(np.max(np.abs(expected), initial=0.0))
        share = _within(diff, scale)
        if share > worst_share:
            worst, worst_share, worst_abs, worst_scale = name, share, diff, scale
    passed = worst_share <= 1.0 and _within(loss_diff, abs(reference.loss)) <= 1.0
    relative = worst_abs / worst_scale if worst_scale > 0 else (0.0 if worst_abs == 0 else math.inf)
    return BatchCheck(
        batch, "passed" if passed else "mismatch", loss, loss_diff, worst, worst_abs, relative, worst_share
    )


def mismatch_message(check: BatchCheck, batches: Sequence[int], folder: Path) -> str:
    """The `ExportError` message of a failed check: what differs, by how much, and what to do."""
    where = f"the new artifacts in {folder} at batch size {check.batch_size} (checked {list(batches)})"
    skip = "or pass export_artifacts(..., verify=False) to keep the artifacts anyway"
    if check.status == "missing gradient":
        return (
            f"One training step of {where} gave no gradient for the trainable parameter {check.worst_parameter!r}, "
            f"which torch trains; freeze it with frozen=[{check.worst_parameter!r}] if it must not train, {skip}."
        )
    if check.status == "non-finite":
        what = f"the gradient of {check.worst_parameter!r}" if check.worst_parameter else f"the loss ({check.loss})"
        return (
            f"One training step of {where} gave a non-finite value in {what}; check the model for operations "
            f"that overflow or divide by zero on random inputs, {skip}."
        )
    return (
        f"One training step of {where} disagrees with torch autograd on the same inputs: the gradient of "
        f"{check.worst_parameter!r} differs by {check.grad_abs_diff:.3g} (relative {check.grad_rel_diff:.3g} of its "
        f"largest value; allowed {ATOL:g} + {RTOL:g} x that value), the loss by {check.loss_diff:.3g}. The training "
        "graph does not compute what the torch model computes: look for a custom autograd.Function, an operation "
        "the ONNX exporter translates differently, or randomness other than dropout (torch.rand, torch.bernoulli), "
        f"{skip}."
    )
