"""The torch reference of export-time verification, computed in a forked process and kept on disk.

The float64 reference holds copies of the model; in the exporting process they would raise its
peak for good. A child forked from it shares the weights' pages, writes each batch's reference to
the job folder and exits; the parent reads one gradient at a time. The child runs torch alone, on
one thread (a forked OpenMP pool hangs); where a fork is unsafe (not Linux, a GPU) the reference
runs in the process.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ort_lightning.errors import ExportError
from ort_lightning.export.verify.job import Gradients
from ort_lightning.export.verify.reference import Reference

__all__ = ["forkable", "load_reference", "run_forked", "save_reference"]

_ERROR_FILE = "reference_error.json"


def forkable(model: torch.nn.Module | None) -> bool:
    """Whether the reference of `model` can run in a forked child: Linux, and every tensor on the CPU."""
    if model is None or not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    tensors = [*model.parameters(), *model.buffers()]
    return all(tensor.device.type == "cpu" for tensor in tensors)


def run_forked(work: Callable[[], None], job: Path) -> None:
    """Run `work` in a forked child, wait for it, and raise what it raised.

    Raises:
        ExportError: for an error of `work`, or a child killed by a signal (the out-of-memory killer).
    """
    error_file = job / _ERROR_FILE
    error_file.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: garbage left in cycles (an ONNX Runtime session of an earlier fit) is finalized here, where
    # ONNX Runtime lives; the child collects no cycles (`_child`).
    gc.collect()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: coverage is not collected after a fork
        os._exit(_child(work, error_file))
    _, status = os.waitpid(pid, 0)
    _raise_for(status, error_file)


def _child(work: Callable[[], None], error_file: Path) -> int:  # pragma: no cover - runs in the forked child
    """Run `work` in the forked child; return its exit status (an error is written to `error_file`)."""
    try:
        # NOTE: the parent's OpenMP pool does not survive the fork: more than one thread hangs here. Nor do
        # ONNX Runtime's threads: a session finalized here (the cycle collector freeing one the parent
        # left) kills the child with SIGSEGV, so the child frees by reference counts alone.
        gc.disable()
        torch.set_num_threads(1)
        work()
    except BaseException as error:  # everything the child meets is reported to the parent, then it exits
        kind = "export" if isinstance(error, ExportError) else type(error).__name__
        detail = "" if kind == "export" else traceback.format_exc()[-2000:]
        error_file.write_text(json.dumps({"kind": kind, "message": str(error), "detail": detail}), encoding="utf-8")
        return 1
    return 0


def _raise_for(status: int, error_file: Path) -> None:
    """Raise the child's error, if it ended with one (`os.waitpid`'s `status`)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
        raise ExportError(
            f"The process computing verification's torch reference (a float64 copy of the model) was killed by "
            f"{name}{' (the system ran out of memory?); free memory, or' if number == signal.SIGKILL else ';'} pass "
            "export_artifacts(..., verify=False) to skip the check and check one training step yourself."
        )
    if os.WEXITSTATUS(status) == 0:
        return
    failure = json.loads(error_file.read_text(encoding="utf-8")) if error_file.is_file() else {}
    if failure.get("kind") == "export":
        raise ExportError(failure["message"])
    raise ExportError(
        f"Computing verification's torch reference failed with {failure.get('kind', 'no report')}: "
        f"{failure.get('message', '')} ({' '.join(failure.get('detail', '').split())[-600:]}); pass "
        "export_artifacts(..., verify=False) to skip the check."
    )


def save_reference(job: Path, batch: int, reference: Reference | None) -> None:
    """Write `batch`'s reference to the job folder: its numbers as JSON, its gradients as ``.npz``."""
    if reference is None:
        return
    names = list(reference.gradients)
    numbers = {
        "loss": reference.loss,
        "noise": reference.noise,
        "kinks": reference.kinks,
        "loss_noise": reference.loss_noise,
        "ambiguous": reference.ambiguous,
        "names": names,
    }
    (job / f"reference_{batch}.json").write_text(json.dumps(numbers), encoding="utf-8")
    arrays: dict[str, Any] = {f"g{index}": np.asarray(reference.gradients[name]) for index, name in enumerate(names)}
    np.savez(job / f"reference_{batch}.npz", **arrays)


@contextlib.contextmanager
def load_reference(job: Path, batch: int) -> Iterator[Reference | None]:
    """`batch`'s reference from the job folder (None if none was written); gradients are read when asked."""
    numbers_file = job / f"reference_{batch}.json"
    if not numbers_file.is_file():
        yield None
        return
    numbers: dict[str, Any] = json.loads(numbers_file.read_text(encoding="utf-8"))
    with np.load(job / f"reference_{batch}.npz") as arrays:
        yield Reference(
            float(numbers["loss"]),
            Gradients(arrays, numbers["names"]),
            noise=numbers["noise"],
            kinks=numbers["kinks"],
            loss_noise=float(numbers["loss_noise"]),
            ambiguous=int(numbers["ambiguous"]),
        )
