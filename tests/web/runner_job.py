"""A job for the device runner in Node (``tests/web/train_device.mjs``), and its result read back.

The job names the folder and the graphs' format; the weights and each batch's tensors are raw little-endian files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ort_lightning.web import asset
from tests._web import ROOT, ort_web_dist, run_node

DRIVER = ROOT / "tests" / "web" / "train_device.mjs"
EPOCHS = 2
#: The runner's tensor type of each numpy dtype the tests send.
TYPES = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64", np.dtype(np.int32): "int32"}


def write_job(
    work: Path, folder: Path, graphs: str, weights: np.ndarray, batches: list[tuple[np.ndarray, ...]]
) -> Path:
    """The driver's job: paths, the format, raw little-endian files for the weights and each tensor."""
    work.mkdir(parents=True, exist_ok=True)
    weights.astype("<f4").tofile(work / "weights.bin")
    listed = []
    for index, batch in enumerate(batches):
        tensors = []
        for position, tensor in enumerate(batch):
            kind = TYPES[tensor.dtype]
            tensor.astype(tensor.dtype.newbyteorder("<")).tofile(work / f"batch{index}-{position}.bin")
            tensors.append({"file": f"batch{index}-{position}.bin", "type": kind, "dims": list(tensor.shape)})
        listed.append(tensors)
    job = {
        "dist": ort_web_dist(), "runner": str(asset("runner.js")), "folder": str(folder), "format": graphs,
        "epochs": EPOCHS, "weights": "weights.bin", "batches": listed,
    }
    (work / "job.json").write_text(json.dumps(job), encoding="utf-8")
    return work / "job.json"


def node_run(job: Path) -> tuple[dict[str, object], np.ndarray, np.ndarray]:
    run_node(DRIVER, str(job))
    result = json.loads((job.parent / "result.json").read_text())
    return result, np.fromfile(job.parent / "trained.bin", "<f4"), np.fromfile(job.parent / "outputs.bin", "<f4")
