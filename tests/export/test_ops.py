"""The op audit's cases (tools/cases.py, the list docs/ops.md is generated from), one real ORT step each.

Every case is exported at one batch size and trained at another; its gradients must match torch
autograd (1e-5 relative), or, for layers that draw random numbers in training, be finite; its eval
graph must match the torch model in eval mode (Dropout off). The
cases listed in REFUSED must fail with the `ExportError` given there, never with a crash.

The fast tier (``pytest -m "not slow"``) runs the first case of each family and every refusal; the
full run all of them. Export verification runs only where this test cannot compare the gradients
itself (the layers that draw random numbers): elsewhere its 1e-5 comparison is the stricter one.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ort_lightning.errors import ExportError
from tests.helpers import tiered
from tools._step import compare_step
from tools.cases import CASES, REFUSED, Case
from tools.op_audit import EXPORT_BATCH, TRAIN_BATCH

TOLERANCE = 1e-5
#: The first case of each family: with the refusals, what the fast tier runs.
FIRST_OF_FAMILY = {next(case.id for case in CASES if case.family == family) for family in {c.family for c in CASES}}


@pytest.mark.parametrize("case", tiered(CASES, ids=[case.id for case in CASES], fast=FIRST_OF_FAMILY | set(REFUSED)))
def test_case(tmp_path: Path, case: Case) -> None:
    torch.manual_seed(0)
    model = case.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.id in REFUSED:
            with pytest.raises(ExportError, match=REFUSED[case.id]):
                compare_step(model, case.inputs(EXPORT_BATCH), case.inputs(TRAIN_BATCH), folder=tmp_path)
            return
        result = compare_step(
            model, case.inputs(EXPORT_BATCH), case.inputs(TRAIN_BATCH), folder=tmp_path, verify=not case.deterministic
        )
    assert result.finite, result
    # The eval graph (Dropout off, parameters as exported) is deterministic for every case.
    assert result.eval_rel <= TOLERANCE, result
    if case.deterministic:
        assert result.output_rel <= TOLERANCE, result
        assert result.grad_rel <= TOLERANCE, result


def test_refusals_name_real_cases() -> None:
    assert set(REFUSED) <= {case.id for case in CASES}
