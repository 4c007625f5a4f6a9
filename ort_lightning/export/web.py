"""`prepare_for_web`: a device folder whose optimizer graph computes its own learning rate.

onnxruntime-web has no call to set the learning rate, so a plain folder trains there at ORT's
default 1e-3. The copy written here computes the rate in its optimizer graph
(`ort_lightning.export.lr_graph`), and is renamed into place whole.

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from ort_lightning import export_artifacts
    >>> root = Path(tempfile.mkdtemp())
    >>> plain = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), root / "plain", verify=False)
    >>> web = prepare_for_web(plain, root / "web", lr=0.01, ort_format=False)
    >>> web.manifest.lr_schedule.describe()
    'constant 0.01, computed in the optimizer graph'
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import onnx

from ort_lightning.artifacts import FILES, MANIFEST_NAME, Manifest, TrainingArtifacts
from ort_lightning.artifacts.adopted import GRAPHS
from ort_lightning.artifacts.schedule import KINDS, GraphSchedule
from ort_lightning.errors import ArtifactError, ExportError
from ort_lightning.export.lr_graph import bake_lr
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.limits import lower_ir_version
from ort_lightning.storage.atomic import fsync

__all__ = ["prepare_for_web"]


def prepare_for_web(
    artifacts: TrainingArtifacts | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    lr: float,
    lr_scheduler: str = "constant",
    warmup_steps: int | float = 0,
    total_steps: int | None = None,
    ort_format: bool = True,
) -> TrainingArtifacts:
    """Write a device folder whose optimizer graph computes its learning rate, for onnxruntime-web.

    The rate follows ``ORTLightningModule`` with the same schedule step for step, whatever rate a
    runtime feeds; the module trains the folder with the same settings and refuses others.

    Args:
        artifacts: a folder with ``.onnx`` graphs, or its `TrainingArtifacts`.
        output_dir: a new or empty folder, or one this function wrote before (replaced whole).
        lr: the peak learning rate.
        lr_scheduler: ``"constant"`` or ``"linear"`` (warmup from 0, then decay to 0 at `total_steps`).
        warmup_steps: optimizer steps of warmup, a count or a fraction in (0, 1) of `total_steps`.
        total_steps: where the linear schedule reaches 0; required for ``"linear"`` (a device has no Trainer).
        ort_format: also write the ``.ort`` graphs.

    Returns:
        The device folder's `TrainingArtifacts`.

    Raises:
        ExportError: for a bad schedule, a folder without ``.onnx`` graphs or optimizer graph, a folder
            already prepared, or an `output_dir` that is the source or holds other files.
    """
    schedule = _schedule(lr, lr_scheduler, warmup_steps, total_steps)
    source = artifacts if isinstance(artifacts, TrainingArtifacts) else TrainingArtifacts.load(artifacts)
    graphs = _onnx_graphs(source)
    output = Path(output_dir)
    _check_output(output, source.directory)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        _write(staging, source, graphs, schedule, ort_format=ort_format)
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TrainingArtifacts.load(output)


def _schedule(lr: float, kind: str, warmup_steps: int | float, total_steps: int | None) -> GraphSchedule:
    """The checked schedule, warmup resolved to a count as ``ORTLightningModule`` resolves it."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not lr > 0:
        raise ExportError(f"Expected `lr` to be a positive float, but got {lr!r}; pass the peak rate, e.g. lr=0.01.")
    if kind not in KINDS:
        raise ExportError(
            f"Expected `lr_scheduler` to be one of {list(KINDS)}, but got {kind!r}; a device folder computes only "
            "these in its optimizer graph (a torch scheduler cannot run there)."
        )
    if kind == "constant":
        if warmup_steps or total_steps is not None:
            raise ExportError(
                f"lr_scheduler='constant' takes no warmup_steps or total_steps, but got warmup_steps={warmup_steps!r}, "
                f"total_steps={total_steps!r}; leave them out, or pass lr_scheduler='linear'."
            )
        return GraphSchedule("constant", float(lr))
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
        raise ExportError(
            f"lr_scheduler='linear' needs `total_steps`, a positive int, but got {total_steps!r}; ORTLightningModule's "
            "total_steps=None means the Trainer's estimated_stepping_batches, and a device has no Trainer: pass the "
            "optimizer steps the device runs from a fresh start (batches per epoch x epochs)."
        )
    fraction = isinstance(warmup_steps, float) and 0 < warmup_steps < 1
    if isinstance(warmup_steps, bool) or warmup_steps < 0 or not (fraction or float(warmup_steps).is_integer()):
        raise ExportError(
            f"Expected `warmup_steps` as a count (int >= 0) or a fraction in (0, 1) of total_steps, but got "
            f"{warmup_steps!r}; pass e.g. warmup_steps=3 or warmup_steps=0.1."
        )
    warmup = round(warmup_steps * total_steps) if fraction else int(warmup_steps)
    return GraphSchedule("linear", float(lr), warmup_steps=warmup, total_steps=total_steps)


def _onnx_graphs(source: TrainingArtifacts) -> dict[str, Path]:
    """The source's ``.onnx`` graphs by role; refuses a folder already prepared or without them."""
    if source.manifest.lr_schedule is not None:
        raise ExportError(
            f"{source.directory} already computes its learning rate in its optimizer graph "
            f"({source.manifest.lr_schedule.describe()}); pass the folder that export_artifacts() wrote, which "
            "prepare_for_web() read, to prepare it with another schedule."
        )
    optimizer = source.optimizer_model
    graphs = {"training_model": source.training_model, "eval_model": source.eval_model}
    if optimizer is not None:
        graphs["optimizer_model"] = optimizer
    missing = [role for role in GRAPHS if role not in graphs or graphs[role].suffix != ".onnx"]
    if missing:
        raise ExportError(
            f"{source.directory} has no {', '.join(FILES[role] for role in missing)}: prepare_for_web() rewrites the "
            "optimizer graph in ONNX and converts the .ort graphs from the .onnx ones; pass a folder with all three "
            ".onnx graphs (export_artifacts() writes them; generate_artifacts() needs an optimizer=)."
        )
    return graphs


def _check_output(output: Path, source: Path) -> None:
    """Refuse writing over the source, or over a folder that holds anything but an earlier device folder."""
    if output.resolve() == source.resolve():
        raise ExportError(
            f"output_dir {output} is the folder being prepared; pass another folder: the source stays as it is, for "
            "the server and for runtimes that set their own rate."
        )
    if output.exists() and (not output.is_dir() or (any(output.iterdir()) and not _prepared(output))):
        raise ExportError(
            f"output_dir {output} exists and holds files that prepare_for_web() did not write; pass a new or empty "
            "folder (a folder it wrote before is replaced whole)."
        )


def _prepared(folder: Path) -> bool:
    """Whether `folder` is a device folder this function wrote (its manifest records a schedule)."""
    path = folder / MANIFEST_NAME
    try:
        return path.is_file() and Manifest.from_json(path.read_text(encoding="utf-8"), path).lr_schedule is not None
    except (ArtifactError, UnicodeDecodeError):  # another tool's file: not a folder this function wrote
        return False


def _write(
    folder: Path, source: TrainingArtifacts, graphs: dict[str, Path], schedule: GraphSchedule, *, ort_format: bool
) -> None:
    """Write the device folder's files into `folder`: graphs, checkpoints, manifest."""
    for role in ("training_model", "eval_model"):
        shutil.copyfile(graphs[role], folder / FILES[role])
    optimizer = onnx.load(graphs["optimizer_model"])
    bake_lr(optimizer, schedule)
    lower_ir_version(optimizer)
    onnx.checker.check_model(optimizer)
    onnx.save(optimizer, folder / FILES["optimizer_model"])
    nominal = source.nominal_checkpoint
    if source.weightless:
        shutil.copyfile(nominal, folder / "nominal_checkpoint")  # type: ignore[arg-type]
    else:
        shutil.copyfile(source.checkpoint, folder / FILES["checkpoint"])
    (folder / MANIFEST_NAME).write_text(replace(source.manifest, lr_schedule=schedule).to_json(), encoding="utf-8")
    _ort.write_device_files(
        folder, [folder / FILES[role] for role in GRAPHS], folder / FILES["checkpoint"],
        ort_format=ort_format, nominal_checkpoint=not source.weightless,
    )


def _publish(staging: Path, output: Path) -> None:
    """Move the finished `staging` folder to `output`, replacing an earlier device folder there."""
    for path in staging.iterdir():
        fsync(path)
    fsync(staging)
    previous = staging.with_name(staging.name + ".previous")
    if output.exists():
        os.replace(output, previous)
    os.replace(staging, output)
    fsync(output.parent)
    shutil.rmtree(previous, ignore_errors=True)
