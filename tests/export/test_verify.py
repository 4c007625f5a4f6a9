"""Export-time verification: one ORT training step in a child process against torch autograd."""

from __future__ import annotations

import copy
import io
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import onnx
import pytest
import torch

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.cli import main as cli_main
from ort_lightning.errors import ArtifactError, ExportError
from ort_lightning.export import after_generation
from ort_lightning.export import source as _export
from ort_lightning.export.verify import job as _job
from ort_lightning.export.verify import verifier as _verify
from ort_lightning.export.verify.compare import BatchCheck, compare, mismatch_message
from ort_lightning.export.verify.reference import Reference
from ort_lightning.ort import runtime as _ort
from tests.conftest import MLP, Exported, SummedMSE, TripledMLP
from tests.helpers import scale_gradient


class AvgPoolNet(torch.nn.Module):
    """Conv -> AvgPool2d -> Linear: ORT 1.19.2's AveragePool gradient dies with SIGFPE under a dynamic batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 2, 3, padding=1)
        self.pool = torch.nn.AvgPool2d(2)
        self.fc = torch.nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.conv(x)).flatten(1))


class FixedBatchView(torch.nn.Module):
    """A forward that hard-codes the example's batch size (``x.view(2, -1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(2, -1))


def _onnx_file(model: torch.nn.Module, example: torch.Tensor, path: Path) -> Path:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            model, (example,), buffer, dynamo=False, input_names=["input"], output_names=["logits"],  # type: ignore[arg-type]
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17,
        )
    path.write_bytes(buffer.getvalue())
    return path


def _inspect(capsys: pytest.CaptureFixture[str], folder: Path) -> str:
    assert cli_main(["inspect", str(folder)]) == 0
    return capsys.readouterr().out


def test_a_good_model_passes_and_the_report_is_in_the_manifest_and_inspect(
    mlp_adamw: Exported, capsys: pytest.CaptureFixture[str]
) -> None:
    report = TrainingArtifacts.load(mlp_adamw.artifacts.directory).manifest.verification
    assert report is not None
    assert report["status"] == "passed"
    assert [check["batch_size"] for check in report["batches"]] == [2, 3]
    for check in report["batches"]:
        assert check["status"] == "passed"
        assert check["worst_parameter"] in mlp_adamw.artifacts.manifest.trainable
        assert check["loss_diff"] <= check["loss_tolerance"]
        assert check["grad_abs_diff"] <= check["grad_tolerance"]
        assert check["grad_float32_noise"] is not None
        assert 0 <= check["tolerance_used"] <= 1
    out = _inspect(capsys, mlp_adamw.artifacts.directory)
    assert re.search(r"verified:\s+passed \(worst margin .*float32 noise", out)
    assert re.search(r"allowed .*float32 noise", out)
    assert re.search(r"batch 3:\s+passed, loss", out)


def test_a_near_zero_gradient_reads_as_such_not_as_a_huge_relative_error() -> None:
    """A bias right before a BatchNorm: its true gradient is 0, so float32 rounding is a ratio of 4.5e+08."""
    largest, off = 2.2e-16, 1e-7
    check = BatchCheck(4, "passed", 1.25, 2e-8, "conv.bias", off, off / largest, 0.01, 1e-5, 1e-6)
    line = check.summary()
    assert line.startswith("passed, loss 1.25 (off by 2e-08); closest to its allowance: the gradient of conv.bias, "
                           "off by 1e-07 where 1e-05 is allowed (float32 noise 1e-06), 1% of the allowance; ")
    assert line.endswith("relative to its largest value (2.2e-16, zero up to rounding) 4.5e+08, which means nothing "
                         "for a gradient that small")
    # a gradient well above its allowance keeps the plain relative difference
    plain = BatchCheck(4, "passed", 1.25, 2e-8, "fc.weight", off, off / 0.5, 0.01, 1e-5, 1e-6).summary()
    assert plain.endswith("; 2e-07 of its largest value")


def test_dropout_and_batchnorm_verify_deterministically(bn_dropout_cnn: Exported) -> None:
    # Dropout(0.5) would make ORT and torch differ at random; both sides run it at ratio 0.
    report = bn_dropout_cnn.artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "passed"
    assert all(check["loss_diff"] < 1e-5 for check in report["batches"])


class FunctionalDropoutMLP(MLP):
    """Dropout called as a function, not held as an nn.Dropout module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.dropout(torch.relu(self.fc1(x)), 0.5, self.training)
        return self.fc2(hidden)


def test_functional_dropout_is_off_on_both_sides(tmp_path: Path) -> None:
    artifacts = export_artifacts(FunctionalDropoutMLP(), torch.randn(4, 4), tmp_path / "functional_dropout")
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "passed"


def test_frozen_parameters_are_not_compared(tmp_path: Path) -> None:
    artifacts = export_artifacts(MLP(), torch.randn(3, 4), tmp_path / "frozen", frozen=["fc1.weight"], loss="mse")
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "passed"
    assert {check["worst_parameter"] for check in report["batches"]} <= {"fc1.bias", "fc2.weight", "fc2.bias"}


def _unlegalized(model: torch.nn.Module, example: torch.Tensor, folder: Path) -> TrainingArtifacts:
    """Artifacts that ORT's generator writes straight from the torch export, with no graph rewrite.

    NOTE: export_artifacts rewrites the ops it knows ORT mishandles (AveragePool under a dynamic
    batch among them); verification is the net for those it does not know, so the crash is
    reproduced here on the graph as the exporter wrote it.
    """
    exported = export_artifacts(model, example, folder, verify=False)
    proto = _export.torch_to_onnx(model, (example,), input_names=["input"])
    _ort.generate(
        proto, trainable=list(exported.manifest.trainable), frozen=[], loss="cross_entropy", optimizer="sgd",
        optimizer_options={}, directory=folder, extra_outputs=["logits"], loss_inputs=["logits"],
    )
    after_generation.finish(
        {"training_model": exported.training_model, "eval_model": exported.eval_model,
         "optimizer_model": exported.optimizer_model}, optimizer="sgd",
    )
    return exported


def test_average_pool_crash_becomes_an_export_error(tmp_path: Path) -> None:
    model = AvgPoolNet()
    artifacts = _unlegalized(copy.deepcopy(model), torch.zeros(4, 1, 8, 8), tmp_path / "avgpool")
    assert "AveragePoolGrad" in {node.op_type for node in onnx.load(artifacts.training_model).graph.node}
    expected = r"killed the verification process with SIGFPE at batch size 4.*AveragePool"
    with pytest.raises(ExportError, match=expected):
        _verify.verify_export(
            artifacts.manifest, artifacts.directory, model=model, example_inputs=torch.zeros(4, 1, 8, 8),
            loss="cross_entropy",
        )
    with pytest.raises(ArtifactError, match=r"export-time verification failed \(.*SIGFPE.*\); they are not loaded"):
        TrainingArtifacts.load(artifacts.directory)


def test_verify_false_skips_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A model that verification refuses (see the next test) exports: no training step ran.
    artifacts = export_artifacts(TripledMLP(), torch.zeros(2, 4), tmp_path / "unchecked", verify=False)
    assert artifacts.manifest.verification == {"status": "skipped"}
    assert re.search(r"verified:\s+skipped", _inspect(capsys, artifacts.directory))


def test_a_torch_model_whose_graph_computes_other_gradients_names_the_worst_parameter(tmp_path: Path) -> None:
    expected = r"disagrees with torch autograd.*gradient of 'fc1\.(weight|bias)' differs from float64 torch by"
    with pytest.raises(ExportError, match=expected):
        export_artifacts(TripledMLP(), torch.zeros(2, 4), tmp_path / "tripled")


def test_a_tampered_training_graph_gives_export_error_naming_the_parameter(tmp_path: Path) -> None:
    model = MLP()
    pristine = copy.deepcopy(model)
    artifacts = export_artifacts(model, torch.zeros(2, 4), tmp_path / "tampered", verify=False)
    scale_gradient(artifacts.training_model, "fc2.bias", 1.5)
    with pytest.raises(ExportError, match=r"gradient of 'fc2\.bias' differs from float64 torch by .*relative 0\.5 "):
        _verify.verify_export(
            artifacts.manifest, artifacts.directory, model=pristine, example_inputs=torch.zeros(2, 4),
            loss="cross_entropy",
        )


def test_onnx_file_source_is_checked_without_a_torch_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _onnx_file(MLP(), torch.zeros(2, 4), tmp_path / "mlp.onnx")
    artifacts = export_artifacts(path, None, tmp_path / "from_onnx")
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "no torch reference"
    assert [check["status"] for check in report["batches"]] == ["no torch reference"] * 2
    assert all(math.isfinite(check["loss"]) for check in report["batches"])
    shown = _inspect(capsys, artifacts.directory)
    assert re.search(r"verified:\s+no torch reference \(an ONNX source or a custom loss block has no torch model to "
                     r"compare with; one training step at each batch size below ran without a crash", shown)
    assert re.search(r"batch 8:\s+ran, loss [\d.]+: finite, no crash or error \(no torch reference", shown)
    # nothing was compared, so no share of an allowance
    assert "margin" not in shown
    assert "tolerance" not in shown


def test_onnx_runtime_error_at_another_batch_size_becomes_an_export_error(tmp_path: Path) -> None:
    path = _onnx_file(FixedBatchView(), torch.zeros(2, 2, 2), tmp_path / "fixed_view.onnx")
    # Without an example, random inputs at batch size 8 (then 9): the view(2, -1) fails at the first.
    with pytest.raises(ExportError, match=r"ONNX Runtime failed one training step .* at batch size 8: "):
        export_artifacts(path, None, tmp_path / "fixed_view")


def test_a_custom_loss_block_is_checked_without_a_torch_reference(tmp_path: Path) -> None:
    artifacts = export_artifacts(MLP(), torch.randn(2, 4), tmp_path / "custom_loss", loss=SummedMSE())
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "no torch reference"
    assert all(math.isfinite(check["loss"]) and check["loss"] > 0 for check in report["batches"])


def test_a_torch_model_that_fails_at_another_batch_size_is_named(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"The torch model itself fails one training step at batch size 3"):
        export_artifacts(FixedBatchView(), torch.zeros(2, 2, 2), tmp_path / "fixed_view_torch")


def test_manifest_without_a_report_still_loads(
    mlp_sgd: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = Path(shutil.copytree(mlp_sgd.artifacts.directory, tmp_path / "old"))
    manifest = folder / "ort_lightning.json"
    data = json.loads(manifest.read_text())
    del data["verification"]
    manifest.write_text(json.dumps(data))
    assert TrainingArtifacts.load(folder).manifest.verification is None
    assert re.search(r"verified:\s+not recorded", _inspect(capsys, folder))


class DividesByZero(MLP):
    """Logits divided by zero: the loss is NaN in torch and in ORT alike."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / 0.0


def test_a_non_finite_step_becomes_an_export_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"gave a non-finite value in the loss \(nan\)"):
        export_artifacts(DividesByZero(), torch.zeros(2, 4), tmp_path / "nan")


def test_a_trainable_parameter_without_an_ort_gradient_is_named(tmp_path: Path) -> None:
    reference = Reference(1.0, {"w": torch.ones(2), "b": torch.ones(1)})
    check = compare(2, reference, 1.0, {"w": torch.ones(2).numpy()}, ["w", "b"])
    assert (check.status, check.worst_parameter) == ("missing gradient", "b")
    message = mismatch_message(check, [2, 3], tmp_path)
    assert re.search(r"gave no gradient for the trainable parameter 'b'.*frozen=\['b'\]", message)


def test_a_verification_past_its_time_limit_becomes_an_export_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_job, "TIMEOUT_S", 0.05)
    with pytest.raises(ExportError, match=r"took longer than 0.05 s .*verify=False"):
        export_artifacts(MLP(), torch.zeros(2, 4), tmp_path / "slow")


def test_a_child_that_cannot_start_becomes_an_export_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The interpreter that runs the child lacks the package's dependencies.
    monkeypatch.setattr(_job, "BOOTSTRAP", "raise SystemExit('No module named onnxruntime')")
    with pytest.raises(ExportError, match=r"exited with status 1 \(No module named onnxruntime\).*import onnxruntime"):
        export_artifacts(MLP(), torch.zeros(2, 4), tmp_path / "no_ort")


class KeywordNet(MLP):
    """A forward of two same-shaped tensors, called with keywords in another order than the graph's."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(x * torch.sigmoid(mask))


def test_dict_example_inputs_reach_the_graph_by_name(tmp_path: Path) -> None:
    model = KeywordNet()
    examples = (torch.randn(2, 4), torch.randn(2, 4))
    artifacts = export_artifacts(model, examples, tmp_path / "keywords", input_names=["x", "mask"], verify=False)
    verified = _verify.verify_export(
        artifacts.manifest, artifacts.directory, model=model, example_inputs={"mask": examples[1], "x": examples[0]},
        loss="cross_entropy",
    )
    assert verified.verification is not None
    assert verified.verification["status"] == "passed"
