"""The plain torch loop that a fit is held to: the blobs loader, the quiet Trainer of 50 steps, torch's own loop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from itertools import cycle

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from tests.conftest import blobs
from tests.helpers import quiet_trainer

STEPS = 50
ADAMW_LR = 0.01


def blob_loader() -> DataLoader:
    x, y = blobs(512, seed=0)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


#: The quiet Trainer of the parity runs; a call's options override these.
parity_trainer = partial(quiet_trainer, max_steps=STEPS, num_sanity_val_steps=0)


def cycled(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    return cycle(list(loader))


def torch_train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    accumulate: int = 1,
    clip: Callable[[list[torch.nn.Parameter]], object] | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    steps: int = STEPS,
) -> list[float]:
    """Train `model` the plain torch way; return the lr each update used."""
    lrs: list[float] = []
    batches = cycled(blob_loader())
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            (F.cross_entropy(model(x), y) / accumulate).backward()
        if clip is not None:
            clip(list(model.parameters()))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return lrs


def assert_same_parameters(module: ORTLightningModule, reference: torch.nn.Module, atol: float = 1e-5) -> None:
    ours = {name: p.detach() for name, p in module.named_parameters()}
    theirs = {name: p.detach() for name, p in reference.named_parameters()}
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def linear_factor(step: int, warmup: int, total: int) -> float:
    """Closed form of the linear warmup/decay multiplier, written here independently of the package."""
    if step < warmup:
        return step / warmup
    return max(0.0, (total - step) / (total - warmup))
