"""The child process of export-time verification: one training step of new artifacts, nothing more.

`ort_lightning.export.verify.verifier` writes a job folder (``job.json``, one ``inputs_<batch>.npz`` per batch
size) and runs this module in a fresh interpreter, because a crash inside ONNX Runtime (SIGFPE,
SIGSEGV) cannot be caught in the process it kills. For each batch size the child prints
``step <batch>`` before the step (so the parent knows where a crash happened), runs one
``train_step`` and writes the loss and every trainable gradient to ``result_<batch>.npz``. An ORT
error is written to ``error.json`` and the child exits with status 3. It never calls the
optimizer: the artifacts on disk are not touched.

Example::

    >>> EXIT_ORT_ERROR
    3
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ort_lightning.artifacts import TensorSpec
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.ort import runtime as _ort

__all__ = ["EXIT_ORT_ERROR", "main"]

#: Exit status of a child that caught an ONNX Runtime error (written to ``error.json``).
EXIT_ORT_ERROR = 3


def _bind(arrays: Any, names: list[str]) -> tuple[Any, list[torch.Tensor]]:
    """The job's inputs as the OrtValues of one step, bound as training binds a batch (`BatchBinder`)."""
    tensors = [torch.from_numpy(np.ascontiguousarray(arrays[f"i{index}"])) for index in range(len(names))]
    specs = [TensorSpec(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
             for name, tensor in zip(names, tensors, strict=True)]
    # NOTE: the OrtValues borrow the tensors' memory; the caller keeps them alive for the step.
    return BatchBinder(specs, torch.device("cpu"), graph="training").bind(tensors), tensors


def _step(session: _ort.TrainingSession, folder: Path, batch: int, names: list[str]) -> None:
    arrays = np.load(folder / f"inputs_{batch}.npz")
    order = session.input_names()
    if order != names:
        raise ValueError(f"the training graph takes inputs {order}, the job has {names}")
    vector, _tensors = _bind(arrays, names)
    session.lazy_reset_grad()
    fetches = session.train_step(vector)
    # NOTE: DLPack views of ORT's gradient buffers, not copies (a large model's gradients take GBs).
    gradients = {
        name: to_torch(grad).numpy()
        for name, _data, grad, trainable in session.parameters()
        if trainable and grad is not None
    }
    result: dict[str, Any] = {"loss": np.asarray(fetches[0].numpy(), dtype=np.float64)}
    result.update({f"g{index}": gradients[name] for index, name in enumerate(sorted(gradients))})
    np.savez(folder / f"result_{batch}.npz", **result)
    (folder / f"result_{batch}.json").write_text(json.dumps(sorted(gradients)), encoding="utf-8")


def main(job_dir: str) -> int:
    """Run the job in `job_dir`; return the exit status (0, or `EXIT_ORT_ERROR`)."""
    folder = Path(job_dir)
    job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
    batch = None
    try:
        session = _ort.assemble(
            training_model=job["training_model"],
            eval_model=job["eval_model"],
            optimizer_model=job["optimizer_model"],
            checkpoint=job["checkpoint"],
        )
        for batch in job["batches"]:
            print(f"step {batch}", flush=True)
            _step(session, folder, batch, job["inputs"])
    except Exception as error:  # ORT raises its own types (Fail, InvalidArgument, ...); all are reported
        message = " ".join(f"{type(error).__name__}: {error}".split())
        (folder / "error.json").write_text(json.dumps({"batch": batch, "error": message}), encoding="utf-8")
        return EXIT_ORT_ERROR
    return 0


if __name__ == "__main__":  # pragma: no cover - run by _verify in a child process
    sys.exit(main(sys.argv[1]))
