"""``python -m benchmarks.large_model``: export and train a model over protobuf's 2 GB, timing each stage.

The model is ``--layers`` x ``nn.Linear(width, width)`` with ReLUs between (8 x 8192: 2.0 GiB of
float32 parameters, just over the 2 GiB a ``ModelProto`` can hold). ``export_artifacts`` takes it
through ONNX external data (automatic above 1 GiB) and verifies one step in its child process;
then a real Trainer runs ``--steps`` AdamW steps on random batches. For each stage it prints the
wall time and the peak resident memory so far, of this process and of its largest child (the
verification child), from ``resource.getrusage`` (``ru_maxrss``).

Usage::

    python -m benchmarks.large_model                 # the run recorded in BENCHMARKS.md (minutes, ~10 GB)
    python -m benchmarks.large_model --quick         # 2 x 64, external data forced: seconds, no usable numbers
"""

from __future__ import annotations

import argparse
import gc
import logging
import resource
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts


def peak_gib() -> tuple[float, float]:
    """Peak resident set size so far of this process and of its largest finished child, in GiB (Linux: KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return own / 2**20, children / 2**20


@contextmanager
def stage(name: str, rows: list[str]) -> Iterator[None]:
    """Time one stage; append its row (seconds, peak RSS of self and children so far) to `rows`."""
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    own, children = peak_gib()
    row = f"| {name} | {seconds:.1f} | {own:.2f} | {children:.2f} |"
    rows.append(row)
    print(row, flush=True)


def build(layers: int, width: int) -> torch.nn.Module:
    """``layers`` x Linear(width, width), ReLU between them."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for index in range(layers):
        blocks.append(torch.nn.Linear(width, width))
        if index < layers - 1:
            blocks.append(torch.nn.ReLU())
    return torch.nn.Sequential(*blocks)


def train(artifacts_folder: Path, width: int, *, steps: int, batch: int) -> list[float]:
    """`steps` AdamW steps under a real Trainer on random batches; return the losses."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(steps * batch, width, generator=generator)
    y = torch.randint(0, width, (steps * batch,), generator=generator)
    module = ORTLightningModule(str(artifacts_folder), lr=1e-4, lr_scheduler="constant")
    losses: list[float] = []

    class _Losses(pl.Callback):
        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object, *args: object
        ) -> None:
            losses.append(float(outputs["loss"]))  # type: ignore[index]

    trainer = pl.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_Losses()],
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=batch))
    return losses


def run(layers: int, width: int, *, steps: int, batch: int, folder: Path, external_data: bool | None) -> list[str]:
    """Build, export (with verification) and train; return the table rows."""
    rows = ["| stage | seconds | peak RSS, this process (GiB) | peak RSS, largest child (GiB) |", "|---|---|---|---|"]
    with stage("build the torch model", rows):
        model = build(layers, width)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"parameters: {size / 2**30:.3f} GiB ({size} bytes)", flush=True)
    with stage("export_artifacts (export, legalize, generate, checkpoint, verify)", rows):
        artifacts = export_artifacts(
            model, torch.randn(batch, width), folder, loss="cross_entropy", external_data=external_data
        )
    report = artifacts.manifest.verification or {}
    print(f"verification: {report.get('status')} in {report.get('seconds')} s; {report.get('reason', '')}")
    # NOTE: ONNX Runtime writes a checkpoint over about 2 GB as `checkpoint` plus `checkpoint.data`.
    checkpoint = sum(path.stat().st_size for path in folder.glob("checkpoint*"))
    print(
        f"checkpoint: {checkpoint / 2**30:.3f} GiB; graphs: "
        + ", ".join(f"{p.name} {p.stat().st_size / 2**10:.0f} KiB" for p in sorted(folder.glob("*.onnx")))
    )
    del model, artifacts
    gc.collect()
    with stage(f"train {steps} AdamW steps (Trainer, batch {batch})", rows):
        losses = train(folder, width, steps=steps, batch=batch)
    print("losses: " + ", ".join(f"{loss:.4f}" for loss in losses), flush=True)
    if not all(torch.isfinite(torch.tensor(losses))):
        raise SystemExit("a training loss is not finite")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 x 64 with external data forced: a smoke run")
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    layers, width = (2, 64) if args.quick else (args.layers, args.width)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ort-lightning-large-") as folder:
        rows = run(
            layers,
            width,
            steps=args.steps,
            batch=args.batch,
            folder=Path(folder),
            external_data=True if args.quick else None,
        )
    print(f"total: {time.perf_counter() - started:.1f} s")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
