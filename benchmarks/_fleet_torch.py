"""The fleets a user would build instead: Flower's quickstart-pytorch client, the same under Lightning.

`TorchClient` is a Flower ``ClientApp`` written the way Flower's quickstart-pytorch writes its
``client_app.py``: the ``train`` handler builds the ``Net``, loads the message's state dict into
it, trains it with a plain torch loop on the device's partition and replies with its
``state_dict()`` and ``num-examples``. Its optimizer is torch's AdamW with the options the ORT
artifacts' optimizer graph was exported with, so that both fleets train the same model the same
way. `TorchGlobalModel` is the server's side: it holds the global values in the same ``Net``,
evaluates them on the held-out digits and writes each round with ``torch.save`` (the
quickstart's checkpoint), so that the same `FleetServer` round loop runs every fleet.

`LightningTorchClient` trains the same ``Net`` under a ``lightning.Trainer``, reusing one module
and one Trainer per worker as ort-lightning's devices do (`ort_lightning.fleet.devices.trainer_slots`): the
difference between it and the ort fleet is ORT's alone, the difference between it and the torch
fleet is Lightning's own cost of a fit.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from ort_lightning.demo import digits_mlp
from ort_lightning.fleet.devices.protocol import DataFn
from ort_lightning.fleet.devices.trainer_slots import fresh_loops

#: torch.optim.AdamW's defaults, the options ``export_artifacts(optimizer="adamw")`` exports.
ADAMW = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def train_fn(net: torch.nn.Module, loader: DataLoader, epochs: int, lr: float) -> float:
    """The quickstart's ``train``: a plain torch loop; returns the mean training loss of the last epoch."""
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, **ADAMW)  # type: ignore[arg-type]
    net.train()
    total = batches = 0.0
    for _ in range(epochs):
        total = batches = 0.0
        for images, labels in loader:
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            total += float(loss)
            batches += 1
    return total / max(batches, 1)


@torch.no_grad()
def test_fn(net: torch.nn.Module, loader: DataLoader) -> dict[str, float]:
    """The quickstart's ``test``: mean cross-entropy and accuracy over `loader`."""
    net.eval()
    loss = correct = seen = 0.0
    for images, labels in loader:
        logits = net(images)
        loss += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        correct += float((logits.argmax(1) == labels).sum())
        seen += len(labels)
    return {"loss": loss / seen, "accuracy": correct / seen}


@dataclass(frozen=True)
class TorchClient:
    """Each device of the torch fleet: its partition, local epochs and learning rate (picklable, for Ray)."""

    data: DataFn
    epochs: int = 1
    lr: float = 0.01
    hidden: int = 64
    seed: int = 0

    def client_app(self, *, mods: list[Any] | None = None) -> ClientApp:
        """A Flower ``ClientApp`` with the quickstart's ``train`` handler."""
        app = ClientApp(mods=mods)
        app.train()(self.train)
        return app

    def train(self, msg: Message, context: Context) -> Message:
        """Load the global state dict into a ``Net``, train it locally, reply with its state dict."""
        model = digits_mlp(self.hidden, seed=self.seed)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        config = context.node_config
        loader = self.data(int(config["partition-id"]), int(config["num-partitions"])).train
        started = time.perf_counter()
        train_loss = train_fn(model, loader, self.epochs, self.lr)
        seconds = time.perf_counter() - started
        metrics = {"train_loss": train_loss, "num-examples": len(loader.dataset),  # type: ignore[arg-type]
                   "fit_seconds": seconds}
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)


class DigitsLightning(pl.LightningModule):
    """The quickstart's ``Net`` as a Lightning user writes it: cross-entropy, logged, the same AdamW."""

    def __init__(self, hidden: int, seed: int, lr: float) -> None:
        super().__init__()
        self.net, self.lr = digits_mlp(hidden, seed=seed), lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, **ADAMW)  # type: ignore[arg-type]


#: This worker's module and Trainer of the Lightning fleet, per options (as `fleet.devices.trainer_slots` keeps them).
_LIGHTNING_SLOTS: dict[tuple[int, int, int, float], tuple[DigitsLightning, pl.Trainer]] = {}


@dataclass(frozen=True)
class LightningTorchClient(TorchClient):
    """Each device of the Lightning fleet: the torch ``Net`` under one reused ``Trainer`` per worker."""

    def train(self, msg: Message, context: Context) -> Message:
        """Load the global state dict into the worker's module, fit it with fresh loops, reply with its state dict."""
        key = (self.hidden, self.seed, self.epochs, self.lr)
        if key not in _LIGHTNING_SLOTS:
            trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, max_epochs=self.epochs)
            _LIGHTNING_SLOTS[key] = DigitsLightning(self.hidden, self.seed, self.lr), trainer
        module, trainer = _LIGHTNING_SLOTS[key]
        module.net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        config = context.node_config
        loader = self.data(int(config["partition-id"]), int(config["num-partitions"])).train
        fresh_loops(trainer)
        started = time.perf_counter()
        trainer.fit(module, train_dataloaders=loader)
        seconds = time.perf_counter() - started
        loss = trainer.callback_metrics.get("train_loss")
        metrics = {"train_loss": float("nan") if loss is None else float(loss),
                   "num-examples": len(loader.dataset), "fit_seconds": seconds}  # type: ignore[arg-type]
        content = RecordDict({"arrays": ArrayRecord(module.net.state_dict()), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)


class TorchGlobalModel:
    """The torch fleet's global values: what `FleetServer` asks of a `GlobalModel`, on a torch ``Net``."""

    def __init__(self, hidden: int = 64, seed: int = 0) -> None:
        self.module = digits_mlp(hidden, seed=seed)
        self.server_round = 0

    def arrays(self) -> ArrayRecord:
        """The global values as an ``ArrayRecord`` of the state dict."""
        return ArrayRecord(self.module.state_dict())

    def values(self) -> dict[str, torch.Tensor]:
        """Copies of the global values, by name."""
        return {name: tensor.detach().clone() for name, tensor in self.module.state_dict().items()}

    def load(self, arrays: ArrayRecord, *, server_round: int) -> None:
        """Load aggregated values into the ``Net``."""
        self.module.load_state_dict(arrays.to_torch_state_dict())
        self.server_round = server_round

    def save(self, path: str | os.PathLike[str], *, server_round: int | None = None) -> Path:
        """``torch.save`` the state dict (the quickstart's checkpoint)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.module.state_dict(), path)
        return Path(path)

    def evaluate_fn(self, loader: DataLoader) -> Any:
        """A centralized evaluation for ``Strategy.start(evaluate_fn=...)``."""

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            self.module.load_state_dict(arrays.to_torch_state_dict())
            return MetricRecord(test_fn(self.module, loader))

        return evaluate
