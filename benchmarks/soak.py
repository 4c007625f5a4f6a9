"""``python -m benchmarks.soak``: a long run whose resident memory must stay flat.

Trains a small classifier for ``--steps`` optimizer steps (20,000 by default) under a real
Trainer, with validation and ``self.log`` every step as a user would run it overnight, and
samples the process's resident set size. After a warm-up (allocator pools, thread pools,
Lightning's first epoch) it reports the growth of RSS to the end of the run; DLPack capsules,
OrtValues or fetch vectors that leaked per step would show up here as steady growth.

Usage::

    python -m benchmarks.soak                  # 20,000 steps, prints the RSS figure
    python -m benchmarks.soak --steps 2000     # shorter
    python -m benchmarks.soak --leak-kb 4      # the control: keep 4 KB per step, as a leak would

The figure that decides is the least-squares slope of RSS over the steps after warm-up, in KB
per step: a leak of ``L`` KB per step shows as a slope of about ``L``, while allocator noise
averages out over the run (~0.1-0.4 KB/step on a 1,500-step run). ``--max-kb-per-step`` makes
the script exit 1 above a bound, which the test suite runs in a quick mode with and without
the deliberate leak.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts

#: Share of the run treated as warm-up before the baseline sample.
WARMUP_FRACTION = 0.1


def rss_mb() -> float:
    """Current resident set size of this process in MB, from /proc (Linux)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * 4096 / 2**20


class RSSSampler(pl.Callback):
    """Records ``(global_step, RSS MB)`` every `every` training batches."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.samples: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self.samples.append((trainer.global_step, rss_mb()))


class Leak(pl.Callback):
    """The control: keeps `kb` KB per training step alive, as a leaked buffer would."""

    def __init__(self, kb: int) -> None:
        self.kb = kb
        self.kept: list[bytearray] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # NOTE: bytes(...) with content, so that the pages are touched and count in RSS.
        self.kept.append(bytearray(b"x" * (self.kb * 1024)))


def slope_kb_per_step(samples: list[tuple[int, float]], steps: int) -> float:
    """Least-squares slope of the RSS samples after warm-up, in KB per step."""
    warm = [(step, rss) for step, rss in samples if step >= steps * WARMUP_FRACTION]
    n = len(warm)
    mean_step = sum(step for step, _ in warm) / n
    mean_rss = sum(rss for _, rss in warm) / n
    covariance = sum((step - mean_step) * (rss - mean_rss) for step, rss in warm)
    variance = sum((step - mean_step) ** 2 for step, _ in warm)
    return covariance / variance * 1024 if variance else 0.0


def _loaders(batch: int = 64) -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()
    train = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=generator)
    val = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=256)
    return train, val


def soak(steps: int, folder: Path, *, leak_kb: int = 0) -> tuple[list[tuple[int, float]], float]:
    """Train `steps` steps; return the RSS samples and the growth after warm-up in percent."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    artifacts = export_artifacts(model, torch.zeros(2, 32), folder / "artifacts")
    module = ORTLightningModule(artifacts, lr=1e-3)
    sampler = RSSSampler(every=max(1, steps // 100))
    train, val = _loaders()
    trainer = pl.Trainer(
        max_steps=steps, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, val_check_interval=1.0, default_root_dir=folder,
        callbacks=[sampler, *([Leak(leak_kb)] if leak_kb else [])],
    )
    trainer.fit(module, train, val)
    warm = [rss for step, rss in sampler.samples if step >= steps * WARMUP_FRACTION]
    growth = (warm[-1] - warm[0]) / warm[0] * 100
    return sampler.samples, growth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--leak-kb", type=int, default=0, help="control: keep this many KB per step")
    parser.add_argument("--max-kb-per-step", type=float, default=None, help="exit 1 when the RSS slope exceeds it")
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="ort-lightning-soak-") as folder:
        samples, growth = soak(args.steps, Path(folder), leak_kb=args.leak_kb)
    warm = [rss for step, rss in samples if step >= args.steps * WARMUP_FRACTION]
    print(f"steps: {args.steps}  RSS after warm-up: {warm[0]:.1f} MB  at the end: {warm[-1]:.1f} MB  "
          f"max: {max(warm):.1f} MB  growth after warm-up: {growth:+.2f}%")
    slope = slope_kb_per_step(samples, args.steps)
    print(f"RSS slope after warm-up: {slope:+.3f} KB/step")
    if args.max_kb_per_step is not None and slope > args.max_kb_per_step:
        print(f"RSS grows {slope:.3f} KB per step, above the bound {args.max_kb_per_step} KB/step: a leak.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
