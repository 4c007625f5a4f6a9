"""Export-time verification: one training step of new artifacts in a child process vs torch autograd.

At the example's batch size and one more, a forked child computes torch's float64 reference,
then a fresh interpreter runs one ORT ``train_step`` (Dropout at 0). A crash, an ORT error, a
non-finite value or a difference beyond tolerance is an `ExportError`; the report goes into the
manifest. Over `REFERENCE_LIMIT_BYTES` there is no torch reference, only the step's own checks.

Example::

    >>> report_rows({"status": "passed", "batches": [{"batch_size": 2, "status": "passed", "loss": 1.0}]})
    [('verified', 'passed'), ('batch 2', 'passed, loss 1')]
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ort_lightning.artifacts.manifest import MANIFEST_NAME, UNVERIFIED_NAME, Manifest
from ort_lightning.errors import ExportError
from ort_lightning.export.verify.compare import ATOL, FLOOR, NOISE_FACTOR, BatchCheck, compare, mismatch_message, rule
from ort_lightning.export.verify.forked import forkable, load_reference, run_forked, save_reference
from ort_lightning.export.verify.job import TRAINING_MODEL, read_result, run_child, write_job
from ort_lightning.export.verify.reference import (
    NO_EXAMPLE_BATCH,
    Call,
    Reference,
    batch_inputs,
    labels_for,
    reference_loss,
    torch_reference,
)

__all__ = ["REFERENCE_LIMIT_BYTES", "prepare_batch", "report_rows", "verify_export"]

#: A checkpoint above this many bytes gets no torch reference and no optimizer in the child (`_large_model`).
REFERENCE_LIMIT_BYTES = 1 << 30
def verify_export(
    manifest: Manifest,
    folder: Path,
    *,
    model: Any,
    example_inputs: Any,
    loss: object,
    output: str | None = None,
    enabled: bool = True,
    training_graph: onnx.ModelProto | None = None,
) -> Manifest:
    """Verify the artifacts in `folder` and return `manifest` with its ``verification`` report.

    Raises:
        ExportError: when the step crashes, ORT fails, or the loss or a gradient differs from torch
            autograd beyond tolerance (naming the worst parameter and the difference).
    """
    if not enabled:
        return dataclasses.replace(manifest, verification={"status": "skipped"})
    try:
        report = _check(manifest, folder, model=model, example_inputs=example_inputs, loss=loss, output=output,
                        training_graph=training_graph)
    except ExportError as error:
        # NOTE: a manifest left by an earlier export would make these unverified graphs loadable,
        # and without one the folder would be adopted as generate_artifacts' own: mark it.
        (folder / MANIFEST_NAME).unlink(missing_ok=True)
        (folder / UNVERIFIED_NAME).write_text(str(error).split(";")[0][:300], encoding="utf-8")
        raise
    return dataclasses.replace(manifest, verification=report)


def _check(
    manifest: Manifest, folder: Path, *, model: Any, example_inputs: Any, loss: object, output: str | None,
    training_graph: onnx.ModelProto | None = None,
) -> dict[str, Any]:
    started = time.perf_counter()
    torch_model = model if isinstance(model, torch.nn.Module) else None
    loss_fn = reference_loss(loss)
    size = _checkpoint_bytes(folder)
    large = size > REFERENCE_LIMIT_BYTES
    referenced = torch_model is not None and (loss is None or loss_fn is not None) and not large
    examples, keywords = _examples(example_inputs) if torch_model is not None else (None, None)
    call = Call(keywords, output)
    batches = _batch_sizes(manifest, examples)
    with tempfile.TemporaryDirectory(prefix="ort-lightning-verify-") as tmp:
        job = Path(tmp)
        reference_model = torch_model if referenced else None

        def prepare() -> None:
            for batch in batches:
                reference = prepare_batch(
                    job, folder, manifest, batch, model=reference_model, examples=examples, call=call, loss_fn=loss_fn
                )
                save_reference(job, batch, reference)

        # NOTE: the float64 reference holds about 3 copies of the weights: computed in a forked child,
        # they never count against the exporting process (`forked`).
        run_forked(prepare, job) if forkable(reference_model) else prepare()
        write_job(job, folder, manifest, batches, optimizer=not large, training_graph=training_graph)
        run_child(job, folder, batches)
        checks = []
        for batch in batches:
            with load_reference(job, batch) as reference, read_result(job, batch) as (loss_value, gradients):
                checks.append(compare(batch, reference, loss_value, gradients, manifest.trainable))
    failed = [check for check in checks if check.status not in ("passed", "no torch reference")]
    if failed:
        raise ExportError(mismatch_message(failed[0], batches, folder))
    return {
        "status": "passed" if referenced else "no torch reference",
        **({"reason": _large_model(size)} if large else {}),
        "rule": rule(),
        "noise_factor": NOISE_FACTOR,
        "floor": FLOOR,
        "atol": ATOL,
        "margin": max((check.tolerance_used or 0.0 for check in checks), default=0.0),
        "seconds": round(time.perf_counter() - started, 2),
        "batches": [dataclasses.asdict(check) for check in checks],
    }


def _checkpoint_bytes(folder: Path) -> int:
    """Bytes of the folder's checkpoint, with the external data ONNX Runtime writes beside a large one."""
    return sum(path.stat().st_size for path in (folder / "checkpoint", folder / "checkpoint.data") if path.is_file())


def _large_model(size: int) -> str:
    """Why a checkpoint of `size` bytes gets no torch reference and no optimizer in the child."""
    return (
        f"{size / 2**30:.1f} GiB of weights, over the {REFERENCE_LIMIT_BYTES / 2**30:g} GiB for which torch's "
        "float64 reference is computed (it would hold about 7 more copies of them); crashes, errors and "
        "non-finite values were checked, without loading the optimizer graph"
    )


def prepare_batch(
    job: Path,
    folder: Path,
    manifest: Manifest,
    batch: int,
    *,
    model: torch.nn.Module | None,
    examples: Sequence[torch.Tensor] | None,
    call: Call,
    loss_fn: Any,
) -> Reference | None:
    """Write one batch size's inputs and labels to the job; return torch's reference (`ExportError` if torch fails)."""
    inputs = batch_inputs(manifest.inputs, examples, batch, seed=batch)
    graph_inputs = inputs
    if call.keywords:
        by_name = dict(zip(call.keywords, inputs, strict=True))
        graph_inputs = [by_name[spec.name] for spec in manifest.inputs]
    reference: Reference | None = None
    if model is not None:
        try:
            reference, labels = torch_reference(
                model, inputs, manifest.labels, loss_fn, call=call, trainable=manifest.trainable, seed=batch
            )
        except Exception as error:  # the user's forward or loss may raise anything
            raise ExportError(
                f"The torch model itself fails one training step at batch size {batch} (inputs shaped "
                f"{[tuple(tensor.shape) for tensor in inputs]}): {type(error).__name__}: {error}. Training "
                "batches may have any size; make the forward independent of the example's batch size (no "
                "hard-coded x.view(2, -1)), or pass export_artifacts(..., verify=False) to skip the check."
            ) from error
    else:
        labels = labels_for(manifest.labels, _output_shape(folder, manifest, batch), batch, seed=batch)
    arrays: dict[str, Any] = {f"i{index}": t.numpy() for index, t in enumerate([*graph_inputs, *labels])}
    np.savez(job / f"inputs_{batch}.npz", **arrays)
    return reference


def _examples(example_inputs: Any) -> tuple[list[torch.Tensor], tuple[str, ...] | None]:
    """The example tensors, and their keywords when the forward takes keyword tensors (a dict)."""
    if isinstance(example_inputs, torch.Tensor):
        return [example_inputs], None
    if isinstance(example_inputs, Mapping):
        return list(example_inputs.values()), tuple(example_inputs)
    return list(example_inputs), None


def _batch_sizes(manifest: Manifest, examples: Sequence[torch.Tensor] | None) -> list[int]:
    """The example's batch size and one more (one if the graph fixes it); `NO_EXAMPLE_BATCH` without an example."""
    first = manifest.inputs[0].shape[0] if manifest.inputs and manifest.inputs[0].shape else "batch"
    if isinstance(first, int) and first > 0:
        return [first]
    example = int(examples[0].shape[0]) if examples and examples[0].dim() > 0 else NO_EXAMPLE_BATCH
    return [example, example + 1]


def _output_shape(folder: Path, manifest: Manifest, batch: int) -> tuple[int, ...]:
    """Shape of the model output the loss reads, from the training graph (ONNX sources)."""
    graph = onnx.load(folder / TRAINING_MODEL, load_external_data=False).graph
    wanted = manifest.outputs[0] if manifest.outputs else None
    for output in graph.output:
        if output.name == wanted:
            dims = output.type.tensor_type.shape.dim
            return tuple(
                d.dim_value if d.dim_value > 0 else (batch if i == 0 else NO_EXAMPLE_BATCH) for i, d in enumerate(dims)
            )
    return (batch,)


def report_rows(report: dict[str, Any] | None) -> list[tuple[str, str]]:
    """``(key, value)`` rows for ``ort-lightning inspect``: the status, then one row per batch size."""
    if report is None:
        return [("verified", "not recorded (exported before verification existed)")]
    if report.get("status") == "skipped":
        return [("verified", "skipped (export_artifacts(verify=False))")]
    checks = [BatchCheck.from_report(entry) for entry in report.get("batches", [])]
    return [("verified", _status_text(report)), *((f"batch {check.batch_size}", check.summary()) for check in checks)]


def _status_text(report: dict[str, Any]) -> str:
    """The ``verified`` row: the status, then what it means in words, with the report's numbers."""
    status = str(report.get("status", "unknown"))
    if "reason" in report:
        return f"{status} ({report['reason']})"
    if status == "no torch reference":
        return (f"{status} (an ONNX source or a custom loss block has no torch model to compare with; one training "
                "step at each batch size below ran without a crash, an ORT error or a NaN/inf)")
    if "rule" in report:
        margin = float(report.get("margin", 0.0))
        return (f"{status} (worst margin {margin:.2g}: the largest difference is {margin * 100:.2g}% of what float32 "
                f"rounding allows; {report['rule']})")
    if "rtol" in report and "atol" in report:
        return f"{status} (rtol {report['rtol']:g}, atol {report['atol']:g})"
    return status
