"""Lightning habits: ``to_onnx``, an IterableDataset under ``max_epochs``, the warmup's first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import onnxruntime
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ort_lightning import ORTLightningModule
from ort_lightning.errors import ConfigurationError
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer


def test_to_onnx_writes_the_inference_model_that_predicts_as_torch(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    module.to_onnx(tmp_path / "model.onnx")
    x = torch.randn(5, 4)
    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(logits), mlp_adamw.reference()(x).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "kwargs", "given"),
    [((), {}, r"file_path=None"), (("m.onnx",), {"opset_version": 17}, r"options \['opset_version'\]")],
    ids=["no-path", "export-options"],
)
def test_to_onnx_refuses_what_it_cannot_honour_with_a_pointer(
    mlp_adamw: Exported, args: tuple[Any, ...], kwargs: dict[str, Any], given: str
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(ConfigurationError, match=rf"to_onnx writes the eval graph .*{given}; call "
                                                 r"module\.export_inference_model\(path"):
        module.to_onnx(*args, **kwargs)


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        x, y = blobs(64)
        return iter(zip(x, y, strict=True))


def _fit(module: ORTLightningModule, **options: Any) -> pl.Trainer:
    trainer = quiet_trainer(accelerator="cpu", **options)
    trainer.fit(module, DataLoader(_Stream(), batch_size=16))
    return trainer


def test_an_iterable_dataset_under_max_epochs_says_what_the_linear_schedule_needs(mlp_adamw: Exported) -> None:
    with pytest.raises(ConfigurationError, match=(
        r"^The Trainer cannot estimate the number of optimizer steps of this run \(a dataloader without a length, "
        r"such as an IterableDataset, .*pass ORTLightningModule\(total_steps=\.\.\.\), set "
        r"Trainer\(max_steps=\.\.\.\), or pass lr_scheduler='constant'\.$"
    )):
        _fit(ORTLightningModule(mlp_adamw.artifacts), max_epochs=2)


@pytest.mark.parametrize("options", [{"total_steps": 8}, {"lr_scheduler": "constant"}], ids=["total", "constant"])
def test_an_iterable_dataset_trains_with_either_fix(mlp_adamw: Exported, options: dict[str, Any]) -> None:
    trainer = _fit(ORTLightningModule(mlp_adamw.artifacts, **options), max_epochs=2)
    assert trainer.global_step == 8
