"""Comparing one ORT training step with torch autograd: the noise model, the per-batch check, the messages.

Per parameter, float32's own distance from the float64 reference bounds the difference::

    allowed = NOISE_FACTOR * (|torch32 - torch64| + kinks) + FLOOR * max|torch64| + ATOL

Example::

    >>> import numpy as np, torch
    >>> from ort_lightning.export.verify.reference import Reference
    >>> reference = Reference(1.0, {"w": torch.tensor([1.0, -2.0])})
    >>> compare(4, reference, 1.0, {"w": np.array([1.0, -2.5], dtype=np.float32)}, ["w"]).status
    'mismatch'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ort_lightning.export.verify.reference import Reference

__all__ = ["ATOL", "FLOOR", "NOISE_FACTOR", "BatchCheck", "compare", "mismatch_message", "rule"]

# NOTE: measured (float32, CPU, ORT 1.19.2): ORT's gradients lie within 1-3x torch float32's own
# distance from float64 on MLPs, CNNs with BatchNorm, transformers and LSTMs; ORT's convolutions
# round up to ~10x more than torch's on single activations, which matters only at ReLU kinks
# (their spread is measured apart). Wrong graphs differ by 1e-2 (a gradient scaled by 1.01) or
# more; 8x the noise plus 1e-4 of the gradient's scale sits between the two.
NOISE_FACTOR = 8.0
FLOOR = 1e-4
#: Absolute floor: biases right before a BatchNorm have a true gradient of 0 and show rounding noise only.
ATOL = 1e-6


def rule() -> str:
    """The tolerance rule, as the manifest and ``inspect`` state it."""
    return f"|ort - torch64| <= {NOISE_FACTOR:g} x (float32 noise + ReLU kinks) + {FLOOR:g} x scale + {ATOL:g}"


def _allowed(noise: float, kinks: float, scale: float) -> float:
    return NOISE_FACTOR * (noise + kinks) + FLOOR * scale + ATOL


@dataclass(frozen=True)
class BatchCheck:
    """One batch size's verdict, as kept in the manifest (``passed``, ``mismatch``, ``non-finite`` ...)."""

    batch_size: int
    status: str
    loss: float
    loss_diff: float | None = None
    worst_parameter: str | None = None
    grad_abs_diff: float | None = None
    grad_rel_diff: float | None = None
    #: ``grad_abs_diff / grad_tolerance`` of the worst parameter (its margin): above 1 fails.
    tolerance_used: float | None = None
    #: What the worst parameter was allowed, and the float32 noise and ReLU-kink spread it came from.
    grad_tolerance: float | None = None
    grad_float32_noise: float | None = None
    grad_kinks: float | None = None
    loss_tolerance: float | None = None
    #: ReLU elements within float32 rounding of their kink, on this batch.
    ambiguous_relus: int | None = None

    def summary(self) -> str:
        """One line: status and the differences (the batch size is the caller's label)."""
        if self.status == "no torch reference":
            return f"ran, loss {self.loss:.6g}: finite, no crash or error (no torch reference to compare it with)"
        text = f"{self.status}, loss {self.loss:.6g}"
        if self.loss_diff is not None:
            text += f" (off by {self.loss_diff:.2g})"
        if self.worst_parameter is None or self.grad_abs_diff is None:
            return text
        text += f"; closest to its allowance: the gradient of {self.worst_parameter}, off by {self.grad_abs_diff:.2g}"
        if self.grad_tolerance is not None:
            text += f" where {self.grad_tolerance:.2g} is allowed (float32 noise {self.grad_float32_noise:.2g}"
            text += f", ReLU kinks {self.grad_kinks:.2g})" if self.grad_kinks else ")"
        if self.tolerance_used is not None:
            text += f", {_percent(self.tolerance_used)} of the allowance"
        return f"{text}; {self._relative()}"

    def _relative(self) -> str:
        """The relative difference, or why it means nothing for a gradient that is zero up to rounding."""
        relative, absolute = self.grad_rel_diff or 0.0, self.grad_abs_diff or 0.0
        largest = absolute / relative if relative > 0 and math.isfinite(relative) else None
        if largest is not None and self.grad_tolerance is not None and largest <= self.grad_tolerance:
            # NOTE: e.g. a bias right before a BatchNorm: its true gradient is 0, so any rounding is a huge ratio.
            return (f"relative to its largest value ({largest:.2g}, zero up to rounding) {relative:.2g}, "
                    "which means nothing for a gradient that small")
        return f"{relative:.2g} of its largest value"

    @classmethod
    def from_report(cls, entry: dict[str, Any]) -> BatchCheck:
        """Read one entry of a manifest's report, ignoring fields this version does not know."""
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in entry.items() if key in known})


def _percent(share: float) -> str:
    """A share of the allowance as a percentage with two significant digits (0.002 -> ``0.2%``)."""
    return f"{share * 100:.2g}%"


def _nonfinite(loss: float, gradients: Mapping[str, np.ndarray], trainable: Sequence[str]) -> str | None:
    if not math.isfinite(loss):
        return "the loss"
    return next((name for name in trainable if not np.isfinite(gradients[name]).all()), None)


def compare(
    batch: int, reference: Reference | None, loss: float, gradients: Mapping[str, np.ndarray], trainable: Sequence[str]
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
    loss_allowed = _allowed(reference.loss_noise, 0.0, abs(reference.loss))
    worst, worst_share, worst_abs, worst_scale, worst_allowed = None, -1.0, 0.0, 0.0, 0.0
    for name in trainable:
        expected = np.asarray(reference.gradients[name], dtype=np.float64)
        diff = float(np.max(np.abs(gradients[name].astype(np.float64) - expected), initial=0.0))
        scale = float(np.max(np.abs(expected), initial=0.0))
        allowed = _allowed(reference.noise.get(name, 0.0), reference.kinks.get(name, 0.0), scale)
        if diff / allowed > worst_share:
            worst, worst_share, worst_abs, worst_scale, worst_allowed = name, diff / allowed, diff, scale, allowed
    passed = worst_share <= 1.0 and loss_diff <= loss_allowed
    relative = worst_abs / worst_scale if worst_scale > 0 else (0.0 if worst_abs == 0 else math.inf)
    return BatchCheck(
        batch, "passed" if passed else "mismatch", loss, loss_diff, worst, worst_abs, relative, worst_share,
        grad_tolerance=worst_allowed,
        grad_float32_noise=reference.noise.get(worst, 0.0) if worst else None,
        grad_kinks=reference.kinks.get(worst, 0.0) if worst else None,
        loss_tolerance=loss_allowed,
        ambiguous_relus=reference.ambiguous,
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
        f"{check.worst_parameter!r} differs from float64 torch by {check.grad_abs_diff:.3g} (relative "
        f"{check.grad_rel_diff:.3g} of its largest value), {check.tolerance_used:.3g} times what float32 rounding "
        f"explains (allowed {check.grad_tolerance:.3g}: {rule()}, float32 noise {check.grad_float32_noise:.3g}); "
        f"the loss by {check.loss_diff:.3g} (allowed {check.loss_tolerance:.3g}). The training "
        "graph does not compute what the torch model computes: look for a custom autograd.Function, an operation "
        "the ONNX exporter translates differently, or randomness other than dropout (torch.rand, torch.bernoulli), "
        f"{skip}."
    )
