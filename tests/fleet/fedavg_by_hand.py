"""FedAvg by hand, never through ort_lightning.fleet: independent Lightning fits of the devices, averaged here.

Imported after ``pytest.importorskip("flwr")``: ort_lightning.fleet needs Flower.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.fleet import ClientData
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

LR = 0.05
EPOCHS = 2
SIZES = (12, 20, 8)  # unequal, so that weighting by example count matters


def iid_data(partition: int, partitions: int) -> ClientData:
    x, y = blobs(sum(SIZES), seed=7)
    start = sum(SIZES[:partition])
    part = slice(start, start + SIZES[partition])
    return ClientData(train=DataLoader(TensorDataset(x[part], y[part]), batch_size=4))


def module_values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in (*module.named_parameters(), *module.named_buffers())}


#: The quiet Trainer of the devices' fits; a call's options override these.
_trainer = partial(quiet_trainer, max_epochs=EPOCHS, accelerator="cpu", devices=1)


def _fit(exported: Exported, start: Path | None, data: ClientData) -> tuple[dict[str, torch.Tensor], int]:
    module = ORTLightningModule(exported.artifacts, lr=LR, lr_scheduler="constant", checkpoint=start)
    _trainer().fit(module, train_dataloaders=data.train)
    return module_values(module), len(data.train.dataset)  # type: ignore[arg-type]


def _average(fits: list[tuple[dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    total = sum(count for _, count in fits)
    return {name: sum(values[name].double() * count for values, count in fits) / total for name in fits[0][0]}


@torch.no_grad()
def _checkpoint_of(exported: Exported, values: dict[str, torch.Tensor], path: Path) -> Path:
    module = ORTLightningModule(exported.artifacts)
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        tensor.copy_(values[name].float())
    return module.save_ort_checkpoint(path, include_optimizer_state=False)


def fedavg_by_hand(
    exported: Exported, data: Callable[[int, int], ClientData], rounds: list[list[int]], folder: Path
) -> list[tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]]:
    """Per round: the example-weighted average of the listed devices' fits, and the fits themselves."""
    start: Path | None = None
    results = []
    for number, devices in enumerate(rounds, start=1):
        fits = [_fit(exported, start, data(device, len(SIZES))) for device in devices]
        average = _average(fits)
        start = _checkpoint_of(exported, average, folder / f"reference-{number}.ortckpt")
        results.append((average, [values for values, _ in fits]))
    return results


def values_in(exported: Exported, path: Path) -> dict[str, torch.Tensor]:
    return module_values(ORTLightningModule(exported.artifacts, checkpoint=path))


def assert_values_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(actual[name].double(), expected[name], rtol=0, atol=2e-6, msg=name)
