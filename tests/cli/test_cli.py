"""The ``ort-lightning`` console script, run as a user runs it: a real subprocess."""

from __future__ import annotations

import math
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnxruntime.training.api import CheckpointState

from ort_lightning.cli.console import ERROR_PREFIX, main
from tests.cli.mistakes import MISTAKES
from tests.cli.script import SCRIPT, run_script
from tests.helpers import cli_error_line

pytestmark = pytest.mark.slow  # console-script runs


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    run_script("export", "ort_lightning.demo:digits_mlp", "--input-shape", "64", "--out", folder / "art", cwd=folder)
    return folder / "art"


def test_demo_reaches_95_percent_and_writes_its_outputs(tmp_path: Path) -> None:
    result = run_script("demo", "--out", tmp_path / "demo", "--epochs", "10", cwd=tmp_path)
    # the README's command into pipes: one line per epoch and a few more, no progress bar, no Lightning notices
    printed = (result.stdout + result.stderr).splitlines()
    assert len(printed) <= 24, "\n".join(printed)
    assert len([line for line in printed if re.match(r"epoch \d+/10: ", line)]) == 10, result.stdout
    accuracy = float(re.search(r"validation accuracy: ([\d.]+)%", result.stdout).group(1))  # type: ignore[union-attr]
    assert accuracy > 95.0
    assert (tmp_path / "demo" / "artifacts" / "training_model.onnx").is_file()
    checkpoint = Path(re.search(r"ORT checkpoint: +(\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert CheckpointState.load_checkpoint(str(checkpoint)).properties["epoch"] == 9
    shown = run_script("inspect", checkpoint, cwd=tmp_path).stdout
    assert re.search(r"^epoch: +9 \(0-based, as Lightning counts; epoch 10 counting from 1\)$", shown, re.MULTILINE)
    assert re.search(r"^global_step: +\d+$", shown, re.MULTILINE)
    assert re.search(r"^lr: +0 \(for the next optimizer step, the schedule has ended\)$", shown, re.MULTILINE), shown
    # one value column: every "key: value" row starts its value at the same offset
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in shown.splitlines()}) == 1, shown
    model = Path(re.search(r"inference model: +(\S+)", result.stdout).group(1))  # type: ignore[union-attr]
    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert session.run(None, {session.get_inputs()[0].name: np.zeros((3, 64), np.float32)})[0].shape == (3, 10)


#: The digits MLP's parameters (64 -> 64 -> 10, weights and biases), counted independently of the package.
DIGITS_PARAMETERS = 64 * 64 + 64 + 64 * 10 + 10


def _inspect(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """What ``ort-lightning inspect PATH`` prints, from its entry point in this process (the demo's test runs the
    installed script's inspect)."""
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    return capsys.readouterr().out


def test_export_from_factory_then_inspect(digits_artifacts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shown = _inspect(digits_artifacts, capsys)
    assert "input float32 [batch, 64]" in shown
    assert "labels int64 [batch]" in shown
    loss_row = r"^loss: +cross_entropy reduction=mean ignore_index=-100 label_smoothing=0.0$"  # torch's defaults
    assert re.search(loss_row, shown, re.MULTILINE)
    assert "onnx::" not in shown
    assert f"{DIGITS_PARAMETERS:,} values" in shown
    assert "adamw" in shown


def test_inspect_an_ort_checkpoint_file(digits_artifacts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shown = _inspect(digits_artifacts / "checkpoint", capsys)
    assert f"parameters: {DIGITS_PARAMETERS:,} values in 4 tensors ({DIGITS_PARAMETERS:,} trainable)" in shown


def test_export_from_onnx_file_with_options(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.zeros(2, 3),), path, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, do_constant_folding=False)
    first = onnx.load(path).graph.initializer[0]
    frozen, frozen_count = first.name, math.prod(first.dims)
    total = sum(parameter.numel() for parameter in model.parameters())  # 3*5 + 5 + 5*2 + 2
    result = run_script("export", path, "--out", tmp_path / "art", "--loss", "mse", "--optimizer-option",
                 "weight_decay=0.0", "--frozen", frozen, "--report", cwd=tmp_path)
    assert "weight_decay=0.0" in result.stdout
    assert "target float32 [batch, 2]" in result.stdout
    assert re.search(r"\(([\d,]+) trainable\)", result.stdout).group(1) == str(total - frozen_count)  # type: ignore[union-attr]


def test_help_lists_every_subcommand(tmp_path: Path) -> None:
    shown = run_script("--help", cwd=tmp_path).stdout
    for command in ("demo", "export", "inspect", "save-pretrained", "fleet", "fit", "validate", "test", "predict"):
        assert re.search(rf"^ +{command}\s+\S", shown, re.MULTILINE), shown  # a long name's help wraps to the next line


# ----------------------------------------------------------------------------- errors, as a user's shell sees them
#: A few of tests/cli/test_cli_errors.py's mistakes through the installed script, one per way an error is made:
#: argparse, the package's own error, LightningCLI's parser, a file read.
CHILD_MISTAKES = ("misspelled-command", "bad-loss", "misspelled-key", "inspect-lightning-ckpt")

#: A ``sitecustomize`` that prints a line on stderr when torch is imported, as a torch build does on a machine
#: with a CUDA toolkit and no GPU.
NOISY_IMPORT = """
import importlib.abc, sys

class Noise(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("No CUDA runtime is found, using CUDA_HOME='/usr/local/cuda'", file=sys.stderr)
        return None

sys.meta_path.insert(0, Noise())
"""


def _attempt(name: str, folder: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    for file, content in MISTAKES[name].files.items():
        (folder / file).write_bytes(content)
    return subprocess.run([str(SCRIPT), *MISTAKES[name].args], capture_output=True, text=True, cwd=folder,
                          timeout=300, check=False, env=env)


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Run each mistaken command once, and one with a noisy import, side by side (each mostly imports)."""
    noise = tmp_path_factory.mktemp("noise")
    (noise / "sitecustomize.py").write_text(NOISY_IMPORT)
    noisy_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(noise), os.environ.get("PYTHONPATH")]))}
    runs = {name: (name, None) for name in CHILD_MISTAKES}
    runs["noisy-import"] = ("no-shape", noisy_env)

    def attempt(key: str) -> tuple[str, tuple[Path, subprocess.CompletedProcess[str]]]:
        name, env = runs[key]
        folder = tmp_path_factory.mktemp(key)
        return key, (folder, _attempt(name, folder, env))

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        return dict(pool.map(attempt, runs))


@pytest.mark.parametrize("name", CHILD_MISTAKES)
def test_the_console_script_prints_one_error_line_with_status_2(
    mistakes: dict[str, tuple[Path, subprocess.CompletedProcess[str]]], name: str
) -> None:
    folder, result = mistakes[name]
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]  # this torch prints nothing at import
    assert re.search(MISTAKES[name].pattern, cli_error_line(result.stderr)), result.stderr
    assert not (folder / "runs").exists()


def test_a_line_printed_at_import_leaves_the_error_line_last_and_alone(
    mistakes: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    folder, result = mistakes["noisy-import"]
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("No CUDA runtime is found"), result.stderr  # the noise did print
    line = cli_error_line(result.stderr)
    assert re.fullmatch(rf"{ERROR_PREFIX}.*{MISTAKES['no-shape'].pattern}.*", line), line
    assert not (folder / "x").exists()
