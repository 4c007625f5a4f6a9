"""Where verification's copies of the weights live: the float64 reference outside the exporting process."""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ort_lightning import export_artifacts
from ort_lightning.errors import ExportError
from ort_lightning.export.verify import verifier as _verify
from ort_lightning.export.verify.forked import run_forked
from ort_lightning.export.verify.reference import _training_copy
from ort_lightning.ort import runtime as _ort
from tests.conftest import MLP

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference forks on Linux only")


@linux_only
def test_the_torch_reference_is_computed_outside_the_exporting_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    real = _verify.prepare_batch

    def counted(*args: Any, **kwargs: Any) -> Any:  # counts calls and where they ran; the work is the real one
        with pids.open("a") as sink:
            sink.write(f"{os.getpid()}\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(_verify, "prepare_batch", counted)
    artifacts = export_artifacts(MLP(), torch.randn(4, 4), tmp_path / "mlp")
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "passed", report
    assert [check["status"] for check in report["batches"]] == ["passed", "passed"]
    ran_in = [int(line) for line in pids.read_text().split()]
    assert len(ran_in) == 2, ran_in
    assert os.getpid() not in ran_in


def test_the_reference_copy_shares_float32_weights_and_casts_float64_once() -> None:
    model = MLP()
    original = dict(model.named_parameters())
    single = _training_copy(model, ["fc1.weight"], torch.float32)
    double = _training_copy(model, ["fc1.weight"], torch.float64)
    for name, parameter in single.named_parameters():
        assert parameter.data_ptr() == original[name].data_ptr(), name  # no copy of a float32 weight
        assert parameter is not original[name]
        assert parameter.requires_grad == (name == "fc1.weight")
    for name, parameter in double.named_parameters():
        assert parameter.dtype == torch.float64
        torch.testing.assert_close(parameter.float(), original[name].detach(), rtol=0, atol=0)
    assert all(parameter.requires_grad for parameter in model.parameters())  # the user's model is untouched


@linux_only
def test_a_reference_child_killed_by_a_signal_becomes_an_export_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"torch reference \(a float64 copy of the model\) was killed by SIGKILL"):
        run_forked(lambda: os.kill(os.getpid(), signal.SIGKILL), tmp_path)


@linux_only
def test_an_unexpected_error_of_the_reference_child_is_named(tmp_path: Path) -> None:
    def fails() -> None:
        raise RuntimeError("out of shape")

    with pytest.raises(ExportError, match=r"torch reference failed with RuntimeError: out of shape \(.*fails"):
        run_forked(fails, tmp_path)


@linux_only
def test_an_onnx_runtime_session_left_in_a_cycle_is_finalized_before_the_fork(tmp_path: Path) -> None:
    artifacts = export_artifacts(MLP(), torch.randn(4, 4), tmp_path / "mlp", verify=False)
    session = _ort.assemble(
        training_model=str(artifacts.training_model), eval_model=str(artifacts.eval_model),
        optimizer_model=str(artifacts.optimizer_model), checkpoint=str(artifacts.checkpoint),
    )
    cycle: dict[str, Any] = {"session": session}
    cycle["self"] = cycle
    del session, cycle
    # NOTE: finalizing an ONNX Runtime session in a forked child kills it with SIGSEGV; the parent collects first.
    run_forked(gc.collect, tmp_path)
