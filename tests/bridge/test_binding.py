"""The torch parameters stay views of ORT's memory through what Lightning and torch do to them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.errors import BatchError, ConfigurationError
from ort_lightning.training.session.parameters import parameter_views
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

LR = 0.1


#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, num_sanity_val_steps=0)


def _loader(n: int = 256) -> DataLoader:
    x, y = blobs(n, seed=0)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def _ort_pointers(module: ORTLightningModule) -> dict[str, tuple[int, int | None]]:
    """Addresses of ORT's parameter and gradient buffers, read from ORT's state itself."""
    return {
        view.name: (view.data.data_ptr(), None if view.grad is None else view.grad.data_ptr())
        for view in parameter_views(module.ort_session)
    }


def _torch_pointers(module: ORTLightningModule) -> dict[str, tuple[int, int | None]]:
    return {
        name: (p.data_ptr(), None if p.grad is None else p.grad.data_ptr()) for name, p in module.named_parameters()
    }


def test_zero_grad_keeps_the_views_of_ort_gradients(mlp_sgd: Exported) -> None:
    module = ORTLightningModule(mlp_sgd.artifacts, lr=LR)
    module.zero_grad()
    assert _torch_pointers(module) == _ort_pointers(module)
    # The trap this guards against: torch's own zero_grad cuts the views.
    torch.nn.Module.zero_grad(module)
    assert all(p.grad is None for p in module.parameters())
    module.zero_grad()
    assert _torch_pointers(module) == _ort_pointers(module)


class _ClearGrads(L.Callback):
    """Sets every ``.grad`` to None before each batch, as some user code does."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        for parameter in pl_module.parameters():
            parameter.grad = None


def test_cleared_grads_are_bound_again_before_clipping(mlp_sgd: Exported) -> None:
    module = ORTLightningModule(mlp_sgd.artifacts, lr=LR, lr_scheduler="constant")
    _trainer(max_steps=8, gradient_clip_val=0.1, callbacks=[_ClearGrads()]).fit(module, _loader())
    reference = mlp_sgd.reference()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for x, y in list(_loader())[:8]:
        F.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.1)
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(module.get_parameter(name).detach(), parameter.detach(), rtol=0, atol=1e-6)


_SAME_DTYPE: list[tuple[str, Callable[[torch.nn.Module], object]]] = [
    ("to-cpu", lambda m: m.to("cpu")),
    ("cpu", lambda m: m.cpu()),
    ("float", lambda m: m.float()),
    ("to-float32", lambda m: m.to(torch.float32)),
    ("type-float", lambda m: m.type(torch.float32)),
]


@pytest.mark.parametrize("convert", [c for _, c in _SAME_DTYPE], ids=[i for i, _ in _SAME_DTYPE])
def test_same_dtype_conversions_keep_ort_memory(mlp_adamw: Exported, convert: Callable[..., object]) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    convert(module)
    assert _torch_pointers(module) == _ort_pointers(module)
    assert module.dtype == torch.float32
    assert module.device == torch.device("cpu")


_OTHER_DTYPE: list[tuple[str, Callable[[torch.nn.Module], object], str]] = [
    ("half", lambda m: m.half(), "float16"),
    ("double", lambda m: m.double(), "float64"),
    ("bfloat16", lambda m: m.bfloat16(), "bfloat16"),
    ("to-float16", lambda m: m.to(torch.float16), "float16"),
]


@pytest.mark.parametrize(("convert", "dtype"), [c[1:] for c in _OTHER_DTYPE], ids=[c[0] for c in _OTHER_DTYPE])
def test_dtype_conversion_is_refused(mlp_adamw: Exported, convert: Callable[..., object], dtype: str) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    message = rf"ONNX Runtime trains this module in float32.*{dtype}.*keep the module"
    with pytest.raises(ConfigurationError, match=message):
        convert(module)
    assert module.dtype == torch.float32
    assert _torch_pointers(module) == _ort_pointers(module)


class _SkipOddBatches(ORTLightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


def test_training_step_returning_none_skips_the_update_and_resets_gradients(mlp_sgd: Exported) -> None:
    module = _SkipOddBatches(mlp_sgd.artifacts, lr=LR, lr_scheduler="constant")
    _trainer(max_epochs=1).fit(module, _loader())
    reference = mlp_sgd.reference()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for x, y in list(_loader())[::2]:
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(module.get_parameter(name).detach(), parameter.detach(), rtol=0, atol=1e-6)


def test_dict_batch_gives_the_tuple_batch_loss(mlp_adamw: Exported) -> None:
    x, y = blobs(64, seed=3)
    module = ORTLightningModule(mlp_adamw.artifacts)
    as_dict = _trainer().validate(module, DataLoader([{"input": x, "labels": y}], batch_size=None), verbose=False)
    expected = F.cross_entropy(mlp_adamw.reference()(x), y).item()
    assert as_dict[0]["val_loss"] == pytest.approx(expected, rel=1e-5)


def test_wrong_shape_in_a_fit_names_input_and_shape(mlp_adamw: Exported) -> None:
    x, y = blobs(64, seed=3)
    loader = DataLoader(TensorDataset(torch.cat([x, x], dim=1), y), batch_size=32)
    module = ORTLightningModule(mlp_adamw.artifacts)
    message = r"Input 'input' of the training graph expects shape \(batch, 4\), but the batch gives \(32, 8\)"
    with pytest.raises(BatchError, match=message):
        _trainer(max_steps=1).fit(module, loader)


def test_forward_and_predict_return_the_model_outputs(mlp_adamw: Exported) -> None:
    x, y = blobs(64, seed=5)
    module = ORTLightningModule(mlp_adamw.artifacts)
    expected = mlp_adamw.reference()(x).detach()
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)
    predictions = _trainer().predict(module, DataLoader(TensorDataset(x, y), batch_size=16))
    assert predictions is not None
    torch.testing.assert_close(torch.cat(predictions), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]


def test_unknown_lr_scheduler_name_is_refused(mlp_adamw: Exported) -> None:
    message = r"`lr_scheduler` to be 'linear', 'constant' or a callable .* but got 'cosine'"
    with pytest.raises(ConfigurationError, match=message):
        ORTLightningModule(mlp_adamw.artifacts, lr_scheduler="cosine")


def test_factory_returning_no_scheduler_is_refused(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr_scheduler=lambda optimizer: 42)  # type: ignore[arg-type,return-value]
    trainer = _trainer(max_steps=1)
    message = r"`lr_scheduler` to return a torch\.optim\.lr_scheduler\.LRScheduler .* returned int"
    with pytest.raises(ConfigurationError, match=message):
        trainer.fit(module, _loader())


def test_bad_metrics_are_refused(mlp_adamw: Exported) -> None:
    with pytest.raises(ConfigurationError, match=r"`metrics` to be a torchmetrics Metric.*but got list"):
        ORTLightningModule(mlp_adamw.artifacts, metrics=[1, 2])
