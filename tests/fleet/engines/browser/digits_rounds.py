"""The digits fleet that the browser tests run, and its reference: ONNX Runtime's own loop per device.

The reference never goes through ort_lightning.fleet: each device's round is ONNX Runtime's documented
Python loop on the same device files, and the average is taken here, in float64, weighted by example
count. Round checkpoints are read with ORT's own ``CheckpointState``. Imported after
``pytest.importorskip("flwr")``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flwr.serverapp.strategy import FedAvg
from onnxruntime.training.api import CheckpointState

from ort_lightning import TrainingArtifacts
from ort_lightning.fleet import FleetServer, GlobalModel
from ort_lightning.fleet.data.digits import DigitsPartitions
from tests.helpers import ort_device_loop

LR = 0.01
HIDDEN = 16
DEVICES = 3
ROUNDS = 2
DATA = DigitsPartitions(batch_size=32, seed=0)


def reference_rounds(
    folder: Path, start: dict[str, np.ndarray], rounds: list[list[int]], partitions: int = DEVICES, *,
    epochs: int = 1, data: DigitsPartitions | None = None,
) -> list[dict[str, np.ndarray]]:
    """Per round, the example-weighted float64 average of the listed partitions' rounds; float32 goes on.

    Each device trains `epochs` passes over its loader, as torch's DataLoader iterates it epoch after epoch.
    """
    data = data or DATA
    averages = []
    for chosen in rounds:
        # NOTE: the rate the server's Lightning devices use; a folder whose graph ignores it must train at it anyway.
        loaders = {p: data(p, partitions).train for p in chosen}
        fits = [(ort_device_loop(folder, [batch for _ in range(epochs) for batch in loaders[p]], lr=LR, graphs="ort",
                                 values=start),
                 len(loaders[p].dataset))  # type: ignore[arg-type]
                for p in chosen]
        total = sum(count for _, count in fits)
        average = {name: sum(values[name].astype(np.float64) * count for values, count in fits) / total
                   for name in start}
        averages.append(average)
        start = {name: value.astype(np.float32) for name, value in average.items()}
    return averages


def initial_values(exported: TrainingArtifacts) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(exported.checkpoint)).parameters}


def checkpoint_values(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(path)).parameters}


#: The README's tolerance for browsers on the weights: 1e-5 per 1e-3 of rate (AdamW turns a near-zero gradient that
#: two runtimes round differently into a step of the rate's size).
BROWSER_ATOL = 1e-5 * LR / 1e-3


def assert_round(path: Path | None, expected: dict[str, np.ndarray], *, atol: float = 1e-5) -> None:
    """The round checkpoint's values, read by ONNX Runtime, within `atol` of `expected`."""
    assert path is not None
    actual = checkpoint_values(path)
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name].astype(np.float64), value, rtol=0, atol=atol, err_msg=name)


def fedavg_server(
    exported: TrainingArtifacts, folder: Path, *, devices: int = DEVICES, rounds: int = ROUNDS
) -> FleetServer:
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=devices, min_train_nodes=devices)
    return FleetServer(GlobalModel(exported), strategy, rounds=rounds, directory=folder)
