"""Export a small classifier, train it in ONNX Runtime with a Lightning Trainer, print accuracy.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts


def blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three Gaussian blobs in 4-D (generated, nothing to download)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=generator)
    centers = torch.tensor([[3.0, 0, 0, 0], [0, 3.0, 0, 0], [0, 0, 3.0, 0]])
    return centers[labels] + 0.7 * torch.randn(n, 4, generator=generator), labels


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    artifacts = export_artifacts(model, torch.zeros(8, 4), tempfile.mkdtemp(prefix="ort-lightning-"))
    print(f"artifacts: {artifacts.directory}")

    x, y = blobs(2048, seed=0)
    vx, vy = blobs(512, seed=1)
    train = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    val = DataLoader(TensorDataset(vx, vy), batch_size=256)

    module = ORTLightningModule(artifacts, lr=0.01, warmup_steps=0.1)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False)
    trainer.fit(module, train, val)

    accuracy = (module(vx).argmax(dim=1) == vy).float().mean().item()
    print(f"val_loss: {trainer.callback_metrics['val_loss'].item():.4f}  accuracy: {accuracy:.1%}")


if __name__ == "__main__":
    main()
