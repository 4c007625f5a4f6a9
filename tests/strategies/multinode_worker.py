"""One "node" of the two-node torchrun test: ``python -m tests.strategies.multinode_worker ARTIFACTS NODE_DIR``.

Every rank writes ``NODE_DIR/rank.json`` (the ranks Lightning sees) and ``NODE_DIR/state.pt`` (ORT's
parameters after the fit); `ORTCheckpoint` writes ``NODE_DIR/checkpoints`` on global rank 0 only, so
the folder shows which "node" held rank 0.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from ort_lightning.training.session.parameters import parameter_views


class _Ranks(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ranks = {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank,
                 "local_rank": trainer.local_rank, "world_size": trainer.world_size}
        (self.folder / "rank.json").write_text(json.dumps(ranks))
        torch.save({view.name: view.data.clone() for view in parameter_views(pl_module.ort_session)},
                   self.folder / "state.pt")


def main(artifacts: str, folder: str) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    trainer = L.Trainer(
        strategy="ort_ddp", accelerator="cpu", devices=1, num_nodes=2, max_steps=3, logger=False,
        enable_checkpointing=True, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ORTCheckpoint(out / "checkpoints"), _Ranks(out)],
    )
    trainer.fit(ORTLightningModule(artifacts, lr=0.01), DataLoader(TensorDataset(x, y), batch_size=8))


if __name__ == "__main__":
    main(*sys.argv[1:3])
