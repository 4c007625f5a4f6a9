"""The op audit's cases (tools/cases.py, the list docs/ops.md is generated from), one real ORT step each.

Every case is exported at one batch size and trained at another; its gradients must match torch
autograd (1e-5 relative), or, for layers that draw random numbers in training, be finite. The
cases listed in REFUSED must fail with the `ExportError` given there, never with a crash.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ort_lightning.errors import ExportError
from tools._step import compare_step
from tools.cases import CASES, REFUSED, Case
from tools.op_audit import EXPORT_BATCH, TRAIN_BATCH

TOLERANCE = 1e-5


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_case(tmp_path: Path, case: Case) -> None:
    torch.manual_seed(0)
    model = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.id in REFUSED:
            with pytest.raises(ExportError, match=REFUSED[case.id]):
                compare_step(model, case.inputs(EXPORT_BATCH), case.inputs(TRAIN_BATCH), folder=tmp_path)
            return
        result = compare_step(model, case.inputs(EXPORT_BATCH), case.inputs(TRAIN_BATCH), folder=tmp_path)
    assert result.finite, result
    if case.deterministic:
        assert result.output_rel <= TOLERANCE, result
        assert result.grad_rel <= TOLERANCE, result


def test_refusals_name_real_cases() -> None:
    assert set(REFUSED) <= {case.id for case in CASES}
