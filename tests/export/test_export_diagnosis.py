"""A failed torch export names the cause: the user's model, the operator and argument, the module, the fix.

"Check example_inputs" is said only where the inputs are the cause: a forward that raises on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from ort_lightning import export_artifacts
from ort_lightning.errors import ExportError
from ort_lightning.export import symbolics
from tests.decoders import decoder, token_batch


class Patches(nn.Module):
    """Patches folded back into an image: ``nn.Fold`` is ``aten::col2im``, which torch converts from opset 18 on."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(4, 4)
        self.fold = nn.Fold((4, 4), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fold(self.project(x).transpose(1, 2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Patches()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def test_an_op_without_conversion_names_the_op_the_module_and_the_fix(tmp_path: Path) -> None:
    message = (
        r"^torch.onnx.export cannot convert Net: torch's exporter has no conversion of aten::col2im at opset 17, "
        r"called in module 'blocks.0.fold' \(Fold\); torch says: Exporting the operator 'aten::col2im' to ONNX "
        r"opset version 17 is not supported.* To export, replace that call with ops torch exports at opset 17, or "
        r"export the model to ONNX yourself .*report it with this message\.$"
    )
    with pytest.raises(ExportError, match=message) as caught:
        export_artifacts(Net(), torch.zeros(2, 9, 4), tmp_path, loss="mse", verify=False)
    assert "example_inputs" not in str(caught.value)


def test_a_refused_argument_in_a_transformers_attention_names_it_and_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the package's own conversion, the Llama of issue 47 meets torch's refusal of enable_gqa.
    monkeypatch.delitem(symbolics.SYMBOLICS, "aten::scaled_dot_product_attention")
    batch = token_batch(batch=2)
    message = (
        r"^torch.onnx.export cannot convert LlamaForCausalLM: torch's exporter has no conversion of "
        r"aten::scaled_dot_product_attention with enable_gqa=True at opset 17, called in module "
        r"'model.layers.0.self_attn' \(LlamaAttention\); torch says: conversion of scaled_dot_product_attention not "
        r"implemented if enable_gqa is True\. To export, build or load the model with attn_implementation=\"eager\""
    )
    with pytest.raises(ExportError, match=message) as caught:
        export_artifacts(decoder("llama"), {"input_ids": batch["input_ids"], "labels": batch["labels"]}, tmp_path,
                         loss=None, verify=False)
    assert "_Adapter" not in str(caught.value)
    assert "example_inputs" not in str(caught.value)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ((torch.zeros(2, 3), torch.zeros(2, 3)),
         r"^Linear's forward fails on example_inputs \['0: \(2, 3\)', '1: \(2, 3\)'\]: TypeError: .*takes 2 positional "
         r"arguments but 3 were given\. Check that example_inputs is what the model's forward takes"),
        (torch.zeros(2, 4),
         r"^Linear's forward fails on example_inputs \['0: \(2, 4\)'\]: RuntimeError: mat1 and mat2 shapes cannot be "
         r"multiplied .*Check that example_inputs is what the model's forward takes"),
    ],
    ids=["arity", "shape"],
)
def test_a_forward_that_fails_on_the_inputs_says_check_example_inputs(
    inputs: object, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ExportError, match=message):
        export_artifacts(nn.Linear(3, 2), inputs, tmp_path, verify=False)
