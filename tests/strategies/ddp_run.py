"""One training run of real artifacts for the DDP tests, in-process or as ``python -m tests.strategies.ddp_run``.

Under ``strategy="ort_ddp"`` Lightning's subprocess launcher starts this module again for the
other ranks, and torchrun starts it once per rank. Every rank writes ``rank{R}.pt``: its
parameters and buffers, and the strategy's count of gradient all-reduce rounds; rank 0 also
writes the Lightning checkpoint ``last.ckpt``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.training.session.parameters import parameter_views


def dataset(kind: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian blobs in 4-D (``"mlp"``) or random 1x8x8 images with 10 classes (``"cnn"``)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "cnn":
        return torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    labels = torch.randint(0, 3, (n,), generator=generator)
    centers = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    return centers[labels] + 0.5 * torch.randn(n, 4, generator=generator), labels


class RankSlices(L.LightningDataModule):
    """Each rank's own samples, in order: micro-batch j of rank r is ``[(j*world + r)*batch, ... + batch)``.

    With ``world`` ranks of batch B this gives, at every step, the same samples as one process with
    batch ``world*B``. (Lightning's DistributedSampler would shuffle them even with shuffle=False.)
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def train_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        index = torch.arange(len(self.x)).view(-1, world, self.batch)[:, rank].flatten()
        return DataLoader(TensorDataset(self.x[index], self.y[index]), batch_size=self.batch)


class DumpState(L.Callback):
    """At the end of fit, every rank writes ORT's parameters and buffers and its gradient-sync count."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # NOTE: ORT's own state, not the module's tensors: it is what the next step trains.
        state = {view.name: view.data.clone() for view in parameter_views(pl_module.ort_session)}
        syncs = getattr(trainer.strategy, "gradient_syncs", None)
        torch.save({"state": state, "syncs": syncs, "world": trainer.world_size},
                   self.out / f"rank{trainer.global_rank}.pt")


def sgd_nesterov(params: Any) -> torch.optim.Optimizer:
    """The torch optimizer of the hybrid DDP test: SGD with momentum, Nesterov and weight decay."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def train(
    artifacts: str | Path,
    out: str | Path,
    *,
    kind: str = "mlp",
    strategy: str = "auto",
    devices: int = 1,
    batch: int = 8,
    steps: int = 20,
    accumulate: int = 1,
    lr: float = 0.01,
    optimizer: str = "ort",
    samples: int | None = None,
) -> ORTLightningModule:
    """Fit ``steps`` optimizer steps on ``devices`` ranks of ``batch`` samples; return the module.

    The data is one epoch of exactly ``steps`` optimizer steps unless `samples` says otherwise, so
    that ``last.ckpt`` is written at an epoch's end; the lr is constant, so that a run resumed
    from it continues the same schedule whatever its length.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    x, y = dataset(kind, samples or steps * accumulate * batch * devices)
    hybrid = sgd_nesterov if optimizer == "sgd-nesterov" else None
    module = ORTLightningModule(artifacts, lr=lr, optimizer=hybrid, lr_scheduler="constant")
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=accumulate,
        use_distributed_sampler=False, callbacks=[DumpState(out)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, datamodule=RankSlices(x, y, batch))
    trainer.save_checkpoint(out / "last.ckpt")
    return module


def load(out: str | Path, rank: int) -> dict[str, Any]:
    """What rank `rank` wrote."""
    return torch.load(Path(out) / f"rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("artifacts")
    parser.add_argument("out")
    for name, default in (("devices", 2), ("batch", 8), ("steps", 20), ("accumulate", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--kind", default="mlp")
    parser.add_argument("--strategy", default="ort_ddp")
    parser.add_argument("--optimizer", default="ort", choices=["ort", "sgd-nesterov"])
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    train(args.artifacts, args.out, kind=args.kind, strategy=args.strategy, devices=args.devices,
          batch=args.batch, steps=args.steps, accumulate=args.accumulate, optimizer=args.optimizer)


if __name__ == "__main__":
    main()
