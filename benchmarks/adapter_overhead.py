"""What Lightning + ORTLightningModule costs per step over a hand-written ORT loop.

Both sides train the same exported artifacts on batches from the same DataLoader; rounds
alternate (Lightning, hand loop, Lightning, ...) so that machine noise hits both alike. The
step time of a side is the median over rounds of the time between consecutive batch starts,
data loading included. Printed: per-step milliseconds and the ratio Lightning / hand loop, for
a small MLP (overhead-bound) and a larger one (compute-bound).

Run: ``python -m benchmarks.adapter_overhead [--rounds 5] [--steps 40]``
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts, _ort, export_artifacts
from ort_lightning.bridge import BatchBinder

WARMUP = 3


@dataclass(frozen=True)
class Case:
    name: str
    widths: tuple[int, ...]
    batch: int


CASES = (
    Case("small MLP 32-64-10, batch 32", (32, 64, 10), 32),
    Case("compute-bound MLP 512-2048-2048-10, batch 128", (512, 2048, 2048, 10), 128),
)


def _mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _loader(case: Case, steps: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(case.batch * steps, case.widths[0], generator=generator)
    y = torch.randint(0, case.widths[-1], (case.batch * steps,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=case.batch, shuffle=True, generator=generator)


def _per_step(starts: list[float]) -> float:
    kept = starts[WARMUP:]
    return (kept[-1] - kept[0]) / (len(kept) - 1)


class _BatchClock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def _lightning_step(module: ORTLightningModule, loader: DataLoader, steps: int) -> float:
    clock = _BatchClock()
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, loader)
    return _per_step(clock.starts)


def _hand_step(session: _ort.TrainingSession, binder: BatchBinder, loader: DataLoader, steps: int) -> float:
    """The loop a user would write against ORT directly: bind, train_step, optimizer_step, reset."""
    starts = []
    batches = iter(loader)
    for _ in range(steps):
        starts.append(time.perf_counter())
        session.train_step(binder(next(batches)))
        session.optimizer_step()
        session.lazy_reset_grad()
    return _per_step(starts)


def _session(artifacts: TrainingArtifacts) -> _ort.TrainingSession:
    return _ort.assemble(
        training_model=artifacts.training_model,
        eval_model=artifacts.eval_model,
        optimizer_model=artifacts.optimizer_model,
        checkpoint=artifacts.checkpoint,
    )


def run_case(case: Case, folder: Path, *, rounds: int, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    artifacts = export_artifacts(_mlp(case.widths), torch.zeros(2, case.widths[0]), folder / "artifacts")
    module = ORTLightningModule(artifacts, lr=1e-3, lr_scheduler="constant")
    session = _session(artifacts)
    binder = BatchBinder(artifacts.manifest.graph_inputs, torch.device("cpu"), graph="training")
    loader = _loader(case, steps)
    lightning, hand = [], []
    for _ in range(rounds):
        lightning.append(_lightning_step(module, loader, steps))
        hand.append(_hand_step(session, binder, loader, steps))
    return statistics.median(lightning), statistics.median(hand)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    print(f"torch threads: {torch.get_num_threads()}, rounds: {args.rounds}, steps per round: {args.steps}")
    for index, case in enumerate(CASES):
        with tempfile.TemporaryDirectory() as folder:
            lightning, hand = run_case(case, Path(folder) / str(index), rounds=args.rounds, steps=args.steps)
        print(
            f"{case.name}: Lightning+ORT {lightning * 1e3:.3f} ms/step, hand-written ORT loop "
            f"{hand * 1e3:.3f} ms/step, ratio {lightning / hand:.2f}"
        )


if __name__ == "__main__":
    main()
