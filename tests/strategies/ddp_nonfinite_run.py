"""Two ``ort_ddp`` ranks where one rank's batch holds a NaN, for the DDP non-finite tests.

``python -m tests.strategies.ddp_nonfinite_run ARTIFACTS OUT --policy=skip|raise``: rank 1's micro-batch
``POISONED_STEP`` has a NaN input, so only rank 1 sees a NaN loss. Each rank writes ``rank{R}.pt``
(see `tests.strategies.ddp_run.DumpState`) when the fit ends.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import lightning as L
import torch

from ort_lightning import ORTLightningModule
from tests.strategies.ddp_run import DumpState, RankSlices, dataset

STEPS, BATCH, WORLD, POISONED_RANK, POISONED_STEP, LR = 5, 8, 2, 1, 2, 0.01


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of both ranks; rank 1's micro-batch `POISONED_STEP` starts with a NaN."""
    x, y = dataset("mlp", STEPS * WORLD * BATCH, seed=3)
    x[(POISONED_STEP * WORLD + POISONED_RANK) * BATCH, 0] = float("nan")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifacts")
    parser.add_argument("out")
    parser.add_argument("--policy", choices=("skip", "raise"), required=True)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    module = ORTLightningModule(args.artifacts, lr=LR, lr_scheduler="constant", on_nonfinite=args.policy)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ort_ddp", max_steps=STEPS, use_distributed_sampler=False,
        callbacks=[DumpState(out)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=RankSlices(*data(), BATCH))


if __name__ == "__main__":
    main()
