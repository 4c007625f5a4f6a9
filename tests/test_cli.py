"""The ``ort-lightning`` console script, run as a user runs it: a real subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnxruntime.training.api import CheckpointState

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("ort-lightning")
CONFIG = ROOT / "examples" / "digits.yaml"


def run(*args: object, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_one_line_error(result: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ort-lightning: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert re.search(pattern, lines[0]), lines[0]


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    run("export", "ort_lightning.demo:digits_mlp", "--input-shape", "64", "--out", folder / "art", cwd=folder)
    return folder / "art"


def test_demo_reaches_95_percent_and_writes_its_outputs(tmp_path: Path) -> None:
    result = run("demo", "--out", tmp_path / "demo", "--epochs", "10", cwd=tmp_path)
    accuracy = float(re.search(r"validation accuracy: ([\d.]+)%", result.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 95.0
    assert (tmp_path / "demo" / "artifacts" / "training_model.onnx").is_file()
    checkpoint = Path(re.search(r"ORT checkpoint: +(\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert CheckpointState.load_checkpoint(str(checkpoint)).properties["epoch"] == 9
    shown = run("inspect", checkpoint, cwd=tmp_path).stdout
    assert re.search(r"^epoch: +9$", shown, re.MULTILINE)
    assert re.search(r"^global_step: +\d+$", shown, re.MULTILINE)
    assert re.search(r"^lr: +[\d.e-]+$", shown, re.MULTILINE), shown
    model = Path(re.search(r"inference model: +(\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert session.run(None, {session.get_inputs()[0].name: np.zeros((3, 64), np.float32)})[0].shape == (3, 10)


def test_export_from_factory_then_inspect(digits_artifacts: Path) -> None:
    result = run("inspect", digits_artifacts, cwd=digits_artifacts.parent)
    assert "input float32 [batch, 64]" in result.stdout
    assert "labels int64 [batch]" in result.stdout
    # 64*64 + 64 + 64*10 + 10 parameters in the digits MLP, counted independently here.
    assert f"{64 * 64 + 64 + 64 * 10 + 10:,} values" in result.stdout
    assert "adamw" in result.stdout


def test_inspect_an_ort_checkpoint_file(digits_artifacts: Path) -> None:
    result = run("inspect", digits_artifacts / "checkpoint", cwd=digits_artifacts.parent)
    assert "parameters: 4,810 values in 4 tensors (4,810 trainable)" in result.stdout


def test_export_from_onnx_file_with_options(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.zeros(2, 3),), path, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, do_constant_folding=False)
    frozen = onnx.load(path).graph.initializer[0].name
    result = run("export", path, "--out", tmp_path / "art", "--loss", "mse", "--optimizer-option",
                 "weight_decay=0.0", "--frozen", frozen, cwd=tmp_path)
    assert "weight_decay=0.0" in result.stdout
    assert "target float32 [batch, 2]" in result.stdout
    assert re.search(r"\((\d+) trainable\)", result.stdout).group(1) != "27"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["export", "no_colon_here", "--out", "x"], r"package\.module:factory"),
        (["export", "ort_lightning.demo:nothing", "--out", "x", "--input-shape", "64"], r"no callable 'nothing'"),
        (["export", "ort_lightning.demo:digits_mlp", "--out", "x"], r"needs --input-shape"),
        (["export", "ort_lightning.demo:digits_mlp", "--out", "x", "--input-shape", "64", "--loss", "hinge"],
         r"ExportError: Expected `loss` to be one of"),
        (["export", "ort_lightning.demo:digits_mlp", "--out", "x", "--input-shape", "64", "--frozen", "nope"],
         r"Cannot freeze \['nope'\]"),
        (["inspect", "missing"], r"missing does not exist"),
    ],
    ids=["bad-source", "no-factory", "no-shape", "bad-loss", "bad-frozen", "inspect-missing"],
)
def test_errors_are_one_line_without_traceback(tmp_path: Path, args: list[str], pattern: str) -> None:
    assert_one_line_error(run(*args, cwd=tmp_path, ok=False), pattern)


def test_inspect_refuses_a_file_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"not a checkpoint")
    assert_one_line_error(run("inspect", "junk", cwd=tmp_path, ok=False), r"not an ONNX Runtime checkpoint")


def test_lightning_cli_fit_validate_test_predict(digits_artifacts: Path, tmp_path: Path) -> None:
    common = ["--config", CONFIG, "--model.artifacts", digits_artifacts, "--trainer.max_epochs", "1",
              "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", tmp_path]
    run("fit", *common, cwd=tmp_path)
    assert list(tmp_path.rglob("config.yaml")), "LightningCLI saves the resolved config next to the logs"
    validate = run("validate", *common, cwd=tmp_path)
    assert "val_loss" in validate.stdout
    test = run("test", *common, cwd=tmp_path)
    assert "test_loss" in test.stdout
    run("predict", *common, cwd=tmp_path)


def test_lightning_cli_print_config(digits_artifacts: Path, tmp_path: Path) -> None:
    result = run("fit", "--config", CONFIG, "--model.artifacts", digits_artifacts, "--print_config", cwd=tmp_path)
    assert f"artifacts: {digits_artifacts}" in result.stdout
    assert "class_path: ort_lightning.demo.DigitsDataModule" in result.stdout
    assert "optimizer:" not in result.stdout.split("trainer:")[0]


def test_lightning_cli_error_for_missing_artifacts(tmp_path: Path) -> None:
    result = run("fit", "--config", CONFIG, "--model.artifacts", "nothere", cwd=tmp_path, ok=False)
    assert_one_line_error(result, r"ArtifactError: Artifacts folder nothere does not exist")
