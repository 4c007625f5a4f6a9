"""Step-1 loss and gradients, once from a real Trainer over ORT artifacts, once from plain torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule, TrainingArtifacts
from tests.helpers import GradientProbe, quiet_trainer
from tools._step import torch_step

__all__ = ["assert_gradients_close", "ort_steps", "torch_step", "trainer"]


def trainer(steps: int, callbacks: list[Callback]) -> L.Trainer:
    return quiet_trainer(max_steps=steps, num_sanity_val_steps=0, callbacks=callbacks)


def ort_steps(artifacts: TrainingArtifacts, batch: Any, *, steps: int = 1,
              lr: float = 1e-3) -> tuple[list[float], dict[str, torch.Tensor], ORTLightningModule]:
    """Train `steps` steps on the same batch under a real Trainer: losses, step-1 gradients, module."""
    module = ORTLightningModule(artifacts, lr=lr, lr_scheduler="constant")
    capture = GradientProbe()
    trainer(steps, [capture]).fit(module, DataLoader([batch] * steps, batch_size=None))
    return capture.losses, capture.grads, module


def assert_gradients_close(ort: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], *,
                           rtol: float, atol: float) -> float:
    """Same names; each gradient within ``rtol * |g| + atol`` (element-wise); returns the worst relative
    difference ``|g_ort - g| / |g|`` in norm over the parameters whose gradient is not ~0."""
    assert sorted(ort) == sorted(reference)
    worst = 0.0
    for name, grad in reference.items():
        torch.testing.assert_close(ort[name], grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        if float(grad.norm()) > 1e-8:
            worst = max(worst, float((ort[name] - grad).norm() / grad.norm()))
    return worst
