"""One batch check for every entry point: forward, predict, validation, test and training steps."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.errors import BatchError
from tests.conftest import Exported
from tests.helpers import quiet_trainer

#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, max_epochs=1, accelerator="cpu")


def _loader(x: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, torch.zeros(len(x), dtype=torch.long)), batch_size=4)


def _run(entry: str, module: ORTLightningModule, x: torch.Tensor) -> None:
    if entry == "forward":
        module(x)
    elif entry == "predict_step":
        module.predict_step((x, torch.zeros(len(x), dtype=torch.long)), 0)
    elif entry == "trainer.predict":
        _trainer().predict(module, DataLoader(TensorDataset(x), batch_size=4))
    elif entry == "validation_step":
        _trainer().validate(module, _loader(x))
    elif entry == "test_step":
        _trainer().test(module, _loader(x))
    else:
        _trainer().fit(module, _loader(x))


ENTRIES = ["forward", "predict_step", "trainer.predict", "validation_step", "test_step", "training_step"]


@pytest.mark.parametrize("entry", ENTRIES, ids=ENTRIES)
@pytest.mark.parametrize(
    ("x", "given"),
    [(torch.zeros(4, 5), r"\(4, 5\)"), (torch.zeros(4, 4, 1), r"\(4, 4, 1\)")],
    ids=["fixed-dimension", "rank"],
)
def test_a_wrong_shape_is_one_line_at_every_entry_point(
    mlp_adamw: Exported, entry: str, x: torch.Tensor, given: str
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    expected = rf"Input 'input' of the \w+ graph expects shape \(batch, 4\), but the batch gives {given}"
    with pytest.raises(BatchError, match=expected) as info:
        _run(entry, module, x)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)),
         r"forward\(\) expects 1 model input \['input'\], but got 2 tensors; pass \(input\) only"),
        (lambda m: m(), r"forward\(\) expects 1 model input \['input'\], but got 0 tensors"),
        (lambda m: m.predict_step((torch.zeros(2, 4),) * 3, 0),
         r"predict_step\(\) expects 1 model input \['input'\] \(or also the labels \['labels'\]\), but got 3 tensors"),
        (lambda m: m.predict_step({"x": torch.zeros(2, 4)}, 0),
         r"predict_step\(\) expects the model inputs \['input'\], the batch dict lacks \['input'\]"),
        (lambda m: m([[0.0] * 4]), r"Input 'input' of forward\(\) must be a torch.Tensor, but got list"),
    ],
    ids=["forward-with-labels", "forward-without-inputs", "predict-three-tensors", "predict-dict-without-input",
         "forward-list"],
)
def test_forward_and_predict_count_the_model_inputs(
    mlp_adamw: Exported, call: Callable[[ORTLightningModule], object], message: str
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(BatchError, match=message):
        call(module)


def test_predict_step_takes_inputs_with_or_without_labels_as_torch_predicts(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    x = torch.randn(3, 4)
    expected = mlp_adamw.reference()(x).detach()
    for batch in (x, (x,), (x, torch.zeros(3, dtype=torch.long)), {"input": x}):
        torch.testing.assert_close(module.predict_step(batch, 0), expected, rtol=1e-5, atol=1e-6)
