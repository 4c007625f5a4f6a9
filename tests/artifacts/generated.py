"""Folders written by ONNX Runtime's own ``generate_artifacts``, as the adoption tests and others use them.

The cases (loss, optimizer, frozen, ORT format, prefix, the model's own loss), the tiny model, and a
Lightning fit at their batch size.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
from onnxruntime.training import artifacts as ort_artifacts
from onnxruntime.training import onnxblock
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from tests.helpers import quiet_trainer

LR = 0.05
BATCH = 4


class Net(torch.nn.Module):
    """4 -> 5 -> 3, the size of ORT's tutorial models scaled down."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 5)
        self.fc2 = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class OwnLoss(torch.nn.Module):
    """A model that returns its own loss (``generate_artifacts(..., loss=None)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.net(x) - y) ** 2).mean()


class MyTargetL1(onnxblock.Block):
    """A custom loss block whose label input is named ``my_target``: the graph cannot tell it is a label."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = onnxblock.loss.L1Loss()

    def build(self, output_name: str) -> str:
        return self.l1(output_name, target_name="my_target")


def _onnx_model(model: torch.nn.Module, example: tuple[torch.Tensor, ...], names: list[str], output: str) -> Any:
    """Export as ORT's tutorials do: opset 17, no constant folding, training mode."""
    buffer = io.BytesIO()
    axes = {name: {0: "batch"} for name in names}
    if output != "loss":
        axes[output] = {0: "batch"}
    torch.onnx.export(
        model, example, buffer, input_names=names, output_names=[output], opset_version=17,
        do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING, dynamic_axes=axes, dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue())


@dataclass(frozen=True)
class Case:
    """One way of calling ``generate_artifacts``, the batch its graphs take, and what to tell ORTLightningModule."""

    name: str
    options: dict[str, Any]
    label: str = "labels"  # "labels" int64 classes, "target" floats like the output, "" none
    labels_arg: list[str] | None = None
    own_loss: bool = False
    onnx_removed: bool = False
    files: dict[str, str] = field(default_factory=dict)


ALL_PARAMETERS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
HEAD_PARAMETERS = ["fc2.weight", "fc2.bias"]


_LOSSES = {
    "ce": (ort_artifacts.LossType.CrossEntropyLoss, "labels"),
    "mse": (ort_artifacts.LossType.MSELoss, "target"),
    "l1": (ort_artifacts.LossType.L1Loss, "target"),
    "bce": (ort_artifacts.LossType.BCEWithLogitsLoss, "target"),
}
_OPTIMIZERS = {"adamw": ort_artifacts.OptimType.AdamW, "sgd": ort_artifacts.OptimType.SGD}


CASES = [
    *(Case(f"{loss}-{opt}", {"loss": _LOSSES[loss][0], "optimizer": _OPTIMIZERS[opt]}, label=_LOSSES[loss][1])
      for loss in _LOSSES for opt in _OPTIMIZERS),
    Case("head-only-constants", {"requires_grad": HEAD_PARAMETERS, "loss": _LOSSES["mse"][0]}, label="target"),
    Case("head-only-frozen", {"requires_grad": HEAD_PARAMETERS, "frozen_params": ALL_PARAMETERS[:2]}),
    Case("logits", {"additional_output_names": ["logits"]}),
    Case("ort-format", {"ort_format": True, "additional_output_names": ["logits"]}),
    Case("ort-only", {"ort_format": True}, onnx_removed=True),
    Case("prefix", {"prefix": "mobile_", "optimizer": _OPTIMIZERS["sgd"]}),
    Case("custom-loss", {"loss": MyTargetL1()}, label="my_target", labels_arg=["my_target"]),
    Case("own-loss", {"loss": None}, label="", own_loss=True),
]


def generate_folder(case: Case, folder: Path) -> Path:
    torch.manual_seed(0)
    options = {"requires_grad": ALL_PARAMETERS, "optimizer": ort_artifacts.OptimType.AdamW,
               "loss": ort_artifacts.LossType.CrossEntropyLoss, **case.options}
    if case.own_loss:
        model = _onnx_model(OwnLoss(), (torch.randn(2, 4), torch.randn(2, 3)), ["input", "y"], "loss")
        options["requires_grad"] = [f"net.{name}" for name in ALL_PARAMETERS]
    else:
        model = _onnx_model(Net(), (torch.randn(2, 4),), ["input"], "logits")
    folder.mkdir()
    ort_artifacts.generate_artifacts(model, artifact_directory=str(folder), **options)
    if case.onnx_removed:
        for path in folder.glob("*.onnx"):
            path.unlink()
    return folder


def lightning_fit(module: ORTLightningModule, batches: list[tuple[torch.Tensor, ...]]) -> None:
    data = TensorDataset(*(torch.cat(column) for column in zip(*batches, strict=True)))
    quiet_trainer(max_steps=len(batches)).fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
