"""Step-1 loss and gradients, once from a real Trainer over ORT artifacts, once from plain torch."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule, TrainingArtifacts
from tests.helpers import GradientProbe, quiet_trainer
from tools._step import torch_step

__all__ = ["AdamWReference", "assert_gradients_close", "assert_parameters_close", "ort_steps", "torch_adamw_steps",
           "torch_step", "trainer"]


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


@dataclass(frozen=True)
class AdamWReference:
    """Parameters after plain torch's AdamW steps, and torch's own float32 noise on them."""

    parameters: dict[str, torch.Tensor]
    #: The largest ``|float32 - float64|`` over the parameters after the same steps: a comparison with
    #: torch cannot be finer than torch is with itself (AdamW turns a ~0 gradient's noise into lr-sized moves).
    noise_floor: float


def torch_adamw_steps(model: torch.nn.Module, compute: Callable[[torch.nn.Module], torch.Tensor], *, steps: int,
                      lr: float = 1e-3) -> AdamWReference:
    """`steps` steps of ``torch.optim.AdamW(lr=lr)`` (its defaults otherwise) on copies of `model`, each on the
    loss `compute` returns; once in float32 (the reference) and once in float64 (its noise floor).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> reference = torch_adamw_steps(model, lambda m: m(torch.ones(3, 2, dtype=m.weight.dtype)).sum(), steps=2)
        >>> sorted(reference.parameters), reference.noise_floor < 1e-6
        (['bias', 'weight'], True)
    """
    def run(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        trained = copy.deepcopy(model).to(dtype).train()
        optimizer = torch.optim.AdamW(trained.parameters(), lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            compute(trained).backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in trained.named_parameters()}

    single, double = run(torch.float32), run(torch.float64)
    floor = max(float((single[name].double() - double[name]).abs().max()) for name in single)
    return AdamWReference(single, floor)


def assert_parameters_close(ort: Mapping[str, torch.Tensor], reference: AdamWReference, *, atol: float) -> float:
    """Same names; every value within ``max(atol, 3 * reference.noise_floor)`` of torch's; returns the worst
    absolute difference."""
    assert sorted(ort) == sorted(reference.parameters)
    tolerance = max(atol, 3 * reference.noise_floor)
    worst = max(float((ort[name] - value).abs().max()) for name, value in reference.parameters.items())
    assert worst <= tolerance, f"parameters {worst:.2e} off torch's AdamW (tolerance {tolerance:.2e})"
    return worst
