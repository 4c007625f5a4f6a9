"""Two ``ort_ddp`` ranks where one rank dies mid-fit, for the test of what its peer says.

``python -m tests.strategies.ddp_peer_lost_run ARTIFACTS OUT --dead-rank=R``: rank ``R`` writes the time to
``OUT/died`` and ends itself with SIGKILL (as the kernel's OOM killer or a lost machine would) at
the start of optimizer step ``DEATH_STEP``; the other rank then meets the dead one in its next
collective.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L

from ort_lightning import ORTLightningModule
from tests.strategies.ddp_run import RankSlices, dataset

STEPS, BATCH, WORLD, DEATH_STEP = 50, 8, 2, 3


class DieAt(L.Callback):
    """Rank `rank` kills its own process at the start of step `step`, after writing the time to `stamp`."""

    def __init__(self, rank: int, step: int, stamp: Path) -> None:
        self.rank, self.step, self.stamp = rank, step, stamp

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.stamp.write_text(repr(time.time()), encoding="utf-8")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifacts")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dead-rank", type=int, required=True)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = ORTLightningModule(args.artifacts, lr=0.01, lr_scheduler="constant")
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ort_ddp", max_steps=STEPS, use_distributed_sampler=False,
        callbacks=[DieAt(args.dead_rank, DEATH_STEP, args.out / "died")], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, datamodule=RankSlices(*dataset("mlp", STEPS * WORLD * BATCH), BATCH))


if __name__ == "__main__":
    main()
