"""The verification child's job: its files written, its process run, its results read.

The parent writes a job folder (`write_job`: the training graph with its Dropout ratios at 0, the
paths of the other files, the graph inputs' names; ``inputs_<batch>.npz`` per batch size), runs
`ort_lightning.export.verify.child` in a fresh interpreter (`run_child`: a crash, a time-out or an
ORT error becomes an `ExportError`), and reads back each batch's loss and gradients (`read_result`).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ort_lightning.artifacts.manifest import Manifest
from ort_lightning.errors import ExportError
from ort_lightning.export.verify.child import EXIT_ORT_ERROR

__all__ = ["BOOTSTRAP", "TIMEOUT_S", "TRAINING_MODEL", "Gradients", "read_result", "run_child", "write_job"]

#: Seconds one verification child may take before the export gives up on it.
TIMEOUT_S = 600.0
#: The training graph's file name, in the artifacts folder and in the job.
TRAINING_MODEL = "training_model.onnx"
_ZERO_RATIO = "ort_lightning_verify_zero_dropout_ratio"
#: Where the ratio sits among a node's inputs, per Dropout op of the training graph.
_RATIO_INPUT = {"Dropout": 1, "DropoutGrad": 2}

# NOTE: `python -m ort_lightning.export.verify.child` would import the packages' __init__ files, hence
# Lightning: 4.8 s per child instead of 1.8 s here. The child needs only `ort`, `errors`, `artifacts` and
# `bridge` (which binds its inputs as training does), so `ort_lightning` and the two packages above the
# child are empty package objects whose __path__ are the very folders of the parent's code.
#: What the child interpreter runs (``python -c``), given the package's folder and the job folder.
BOOTSTRAP = (
    "import sys, types, os; root = sys.argv[1]\n"
    "for name, path in (('ort_lightning', root), ('ort_lightning.export', os.path.join(root, 'export')),\n"
    "                   ('ort_lightning.export.verify', os.path.join(root, 'export', 'verify'))):\n"
    "    package = types.ModuleType(name); package.__path__ = [path]; sys.modules[name] = package\n"
    "from ort_lightning.export.verify.child import main; sys.exit(main(sys.argv[2]))"
)


def _without_dropout(source: Path | onnx.ModelProto, target: Path) -> None:
    """Copy a training graph (a file, or the graph the export holds) with every Dropout ratio set to 0.

    One step is then deterministic.
    """
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
    else:
        proto = onnx.load(source)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(0.0, dtype=np.float32), _ZERO_RATIO))
    for node in proto.graph.node:
        index = _RATIO_INPUT.get(node.op_type)
        if index is None:
            continue
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = _ZERO_RATIO
    onnx.save(proto, target)


def write_job(
    job: Path, folder: Path, manifest: Manifest, batches: Sequence[int], *, optimizer: bool = True,
    training_graph: onnx.ModelProto | None = None,
) -> None:
    """The child's job: the graphs (the optimizer's only when `optimizer`), the checkpoint, the batches.

    `training_graph` is the training graph as the export saved it (None: read from `folder`).
    """
    _without_dropout(folder / TRAINING_MODEL if training_graph is None else training_graph, job / TRAINING_MODEL)
    spec = {
        "training_model": str(job / TRAINING_MODEL),
        "eval_model": str(folder / "eval_model.onnx"),
        # NOTE: the child never steps the optimizer; AdamW's moments would take two copies of the weights.
        "optimizer_model": str(folder / "optimizer_model.onnx") if optimizer else None,
        "checkpoint": str(folder / "checkpoint"),
        "batches": list(batches),
        "inputs": [spec.name for spec in manifest.graph_inputs],
    }
    (job / "job.json").write_text(json.dumps(spec), encoding="utf-8")


def run_child(job: Path, folder: Path, batches: Sequence[int]) -> None:
    """Run the job's step in a fresh interpreter (`BOOTSTRAP`); its results land in `job`.

    Raises:
        ExportError: for a child past `TIMEOUT_S`, killed by a signal, failed by ONNX Runtime, or that cannot start.
    """
    command = [sys.executable, "-c", BOOTSTRAP, str(Path(__file__).parents[2]), str(job)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as error:
        raise ExportError(
            f"Verifying the new artifacts in {folder} took longer than {TIMEOUT_S:g} s (one training step at "
            f"batch sizes {list(batches)}); pass export_artifacts(..., verify=False) to skip the check for a model "
            "this large, and check one training step yourself."
        ) from error
    if done.returncode == 0:
        return
    steps = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")]
    at = f"batch size {steps[-1]}" if steps else "load (before any step)"
    detail = " ".join(done.stderr.split())[-400:]
    if done.returncode < 0:
        raise ExportError(_crash_message(folder, -done.returncode, at, batches))
    if done.returncode == EXIT_ORT_ERROR:
        failure = json.loads((job / "error.json").read_text(encoding="utf-8"))
        raise ExportError(
            f"ONNX Runtime failed one training step of the new artifacts in {folder} at {at}: "
            f"...{failure['error'][-600:]}. "
            "Training would fail the same way; check the operators and the loss of the model, or pass "
            "export_artifacts(..., verify=False) to keep the artifacts anyway."
        )
    raise ExportError(
        f"The verification process for {folder} exited with status {done.returncode} ({detail or 'no output'}); "
        "check that this Python can import onnxruntime-training, or pass export_artifacts(..., verify=False)."
    )


def _crash_message(folder: Path, signal_number: int, at: str, batches: Sequence[int]) -> str:
    try:
        name = signal.Signals(signal_number).name
    except ValueError:
        name = f"signal {signal_number}"
    graph = onnx.load(folder / TRAINING_MODEL, load_external_data=False).graph
    pools = sorted({node.op_type for node in graph.node if node.op_type.startswith("AveragePool")})
    hint = (
        f" The graph has {'/'.join(pools)} nodes: ONNX Runtime 1.19.2's AveragePool gradient takes its shape from "
        "the graph's static shape and divides by zero under a dynamic batch; where the pool covers the whole "
        "feature map, use nn.AdaptiveAvgPool2d(1) or x.mean((2, 3)) (GlobalAveragePool, which trains)."
        if pools
        else ""
    )
    return (
        f"One training step of the new artifacts in {folder} killed the verification process with {name} at {at} "
        f"(checked batch sizes {list(batches)}); ONNX Runtime would kill the training process the same way.{hint} "
        "Change the model, or pass export_artifacts(..., verify=False) to keep the artifacts anyway."
    )


@contextlib.contextmanager
def read_result(job: Path, batch: int) -> Iterator[tuple[float, Mapping[str, np.ndarray]]]:
    """The child's loss and gradients at `batch`; each gradient is read from disk when the comparison asks."""
    names = json.loads((job / f"result_{batch}.json").read_text(encoding="utf-8"))
    with np.load(job / f"result_{batch}.npz") as arrays:
        yield float(arrays["loss"]), Gradients(arrays, names)


class Gradients(Mapping[str, np.ndarray]):
    """Gradients by parameter name, read one at a time from the child's ``.npz`` (a large model's take GBs)."""

    def __init__(self, arrays: Any, names: Sequence[str]) -> None:
        self._arrays = arrays
        self._keys = {name: f"g{index}" for index, name in enumerate(names)}

    def __getitem__(self, name: str) -> np.ndarray:
        array: np.ndarray = self._arrays[self._keys[name]]
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
