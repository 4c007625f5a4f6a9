"""The ``ort-lightning`` console script, run as a user runs it: a real subprocess."""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import yaml
from onnxruntime.training.api import CheckpointState

pytestmark = pytest.mark.slow  # console-script runs

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


def test_export_from_factory_then_inspect(digits_artifacts: Path) -> None:
    result = run("inspect", digits_artifacts, cwd=digits_artifacts.parent)
    assert "input float32 [batch, 64]" in result.stdout
    assert "labels int64 [batch]" in result.stdout
    loss_row = r"^loss: +cross_entropy reduction=mean ignore_index=-100 label_smoothing=0.0$"  # torch's defaults
    assert re.search(loss_row, result.stdout, re.MULTILINE)
    assert "onnx::" not in result.stdout
    assert f"{DIGITS_PARAMETERS:,} values" in result.stdout
    assert "adamw" in result.stdout


def test_inspect_an_ort_checkpoint_file(digits_artifacts: Path) -> None:
    result = run("inspect", digits_artifacts / "checkpoint", cwd=digits_artifacts.parent)
    assert f"parameters: {DIGITS_PARAMETERS:,} values in 4 tensors ({DIGITS_PARAMETERS:,} trainable)" in result.stdout


def test_export_from_onnx_file_with_options(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, (torch.zeros(2, 3),), path, dynamo=False, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, do_constant_folding=False)
    first = onnx.load(path).graph.initializer[0]
    frozen, frozen_count = first.name, math.prod(first.dims)
    total = sum(parameter.numel() for parameter in model.parameters())  # 3*5 + 5 + 5*2 + 2
    result = run("export", path, "--out", tmp_path / "art", "--loss", "mse", "--optimizer-option",
                 "weight_decay=0.0", "--frozen", frozen, cwd=tmp_path)
    assert "weight_decay=0.0" in result.stdout
    assert "target float32 [batch, 2]" in result.stdout
    assert re.search(r"\(([\d,]+) trainable\)", result.stdout).group(1) == str(total - frozen_count)  # type: ignore[union-attr]


CNN_CONFIG = ROOT / "examples" / "stripes_cnn.yaml"


def test_help_lists_every_subcommand(tmp_path: Path) -> None:
    shown = run("--help", cwd=tmp_path).stdout
    for command in ("demo", "export", "inspect", "fleet", "fit", "validate", "test", "predict"):
        assert re.search(rf"^ +{command} +\S", shown, re.MULTILINE), shown


def _digits_labels() -> torch.Tensor:
    from ort_lightning.demo import DigitsDataModule

    data = DigitsDataModule()
    data.setup("predict")
    return data.val_set.tensors[1]


def _torch_accuracy_of(ckpt: Path) -> float:
    """The held-out digits' accuracy of the .ckpt's weights in the plain torch model, computed here."""
    from ort_lightning.demo import DigitsDataModule, digits_mlp

    model = digits_mlp()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"], strict=False)
    data = DigitsDataModule()
    data.setup("validate")
    images, labels = data.val_set.tensors
    with torch.no_grad():
        return float((model(images).argmax(dim=1) == labels).float().mean())


def _metric(name: str, shown: str) -> float:
    """A metric's value from Lightning's results table."""
    return float(re.search(rf"{name}\W+([\d.]+)", shown).group(1))  # type: ignore[union-attr]


def test_digits_config_trains_as_written_then_evaluates_the_trained_model(tmp_path: Path) -> None:
    tiny = ["--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false"]
    fit = run("fit", "--config", CONFIG, *tiny, cwd=tmp_path)
    assert "exported ort_lightning.demo:digits_mlp to runs/digits/artifacts" in fit.stdout
    assert "LightningCLI's args parameter" not in fit.stderr
    assert (tmp_path / "runs/digits/checkpoints/last.ckpt").is_file()
    evaluate = [*tiny, "--ckpt_path", "last"]
    validate = run("validate", "--config", CONFIG, *evaluate, cwd=tmp_path)
    val_loss = _metric("val_loss", validate.stdout)
    # Untrained, the 10-class cross-entropy is about ln(10) = 2.30; one epoch brings it well below.
    assert val_loss < math.log(10) - 0.5
    test = run("test", "--config", CONFIG, *evaluate, cwd=tmp_path)
    test_loss = _metric("test_loss", test.stdout)
    assert test_loss == pytest.approx(val_loss, abs=1e-6)  # the same held-out images, the same trained model
    # every logged metric is shown, not only the loss: the config's accuracy, as plain torch computes it
    accuracy = _torch_accuracy_of(tmp_path / "runs/digits/checkpoints/last.ckpt")
    assert _metric("val_acc", validate.stdout) == pytest.approx(accuracy, abs=1e-6)
    assert _metric("test_acc", test.stdout) == pytest.approx(accuracy, abs=1e-6)
    predict = run("predict", "--config", CONFIG, *evaluate, cwd=tmp_path)
    written = Path(re.search(r"written to (\S+)", predict.stdout).group(1))  # type: ignore[union-attr]
    assert written == Path("runs/digits/predictions.pt")
    logits = torch.load(tmp_path / written, weights_only=True)
    labels = _digits_labels()
    assert logits.shape == (len(labels), 10)
    assert (logits.argmax(dim=1) == labels).float().mean() > 0.7
    # evaluation runs log nothing: the fit's logs are the only version
    assert [p.name for p in (tmp_path / "runs/digits/lightning_logs").iterdir()] == ["version_0"]


def test_cnn_config_trains_as_written(tmp_path: Path) -> None:
    tiny = ["--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    fit = run("fit", "--config", CNN_CONFIG, *tiny, cwd=tmp_path)
    assert "exported ort_lightning.demo:stripes_cnn" in fit.stdout
    test = run("test", "--config", CNN_CONFIG, *tiny, "--ckpt_path", "last", cwd=tmp_path)
    test_loss = float(re.search(r"test_loss\W+([\d.]+)", test.stdout).group(1))  # type: ignore[union-attr]
    assert test_loss < math.log(4) - 0.3  # 4 classes: ln(4) = 1.39 untrained


def test_lightning_cli_print_config(digits_artifacts: Path, tmp_path: Path) -> None:
    result = run("fit", "--config", CONFIG, "--model.artifacts", digits_artifacts, "--print_config", cwd=tmp_path)
    assert f"artifacts: {digits_artifacts}" in result.stdout
    assert "class_path: ort_lightning.demo.DigitsDataModule" in result.stdout
    config = yaml.safe_load(result.stdout)
    assert "optimizer" not in config
    assert "lr_scheduler" not in config
    assert config["export"]["factory"] == "ort_lightning.demo:digits_mlp"


# ----------------------------------------------------------------------------- errors
@dataclass(frozen=True)
class Mistake:
    """A command with one mistake, the files it needs in its folder, and the one error line it must print."""

    args: tuple[str, ...]
    pattern: str
    files: dict[str, bytes] = field(default_factory=dict)


def _torch_ckpt() -> bytes:
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, buffer)
    return buffer.getvalue()


def _fit(*args: str) -> tuple[str, ...]:
    return ("fit", "--config", str(CONFIG), *args)


FACTORY = ("export", "ort_lightning.demo:digits_mlp", "--out", "x")
MISTAKES = {
    # export / inspect / the subcommand itself (argparse)
    "bad-source": Mistake(("export", "no_colon_here", "--out", "x"), r"package\.module:factory"),
    "no-factory": Mistake(("export", "ort_lightning.demo:nothing", "--out", "x", "--input-shape", "64"),
                          r"no callable 'nothing'"),
    "no-shape": Mistake(FACTORY, r"needs --input-shape"),
    "bad-loss": Mistake((*FACTORY, "--input-shape", "64", "--loss", "hinge"),
                        r"ExportError: Expected `loss` to be one of"),
    "bad-frozen": Mistake((*FACTORY, "--input-shape", "64", "--frozen", "nope"), r"Cannot freeze \['nope'\]"),
    "shape-with-x": Mistake((*FACTORY, "--input-shape", "3x32x32"),
                            r"bad --input-shape '3x32x32'.*e\.g\. --input-shape 3,32,32"),
    "shape-for-cnn": Mistake(("export", "ort_lightning.demo:stripes_cnn", "--out", "x", "--input-shape", "64"),
                             r"cannot run on inputs of shape \(batch, 64\).*--input-shape"),
    "bad-optimizer-option": Mistake((*FACTORY, "--input-shape", "64", "--optimizer-option", "wd"),
                                    r"bad --optimizer-option 'wd': expected KEY=NUMBER"),
    "misspelled-option": Mistake((*FACTORY, "--input-shape", "64", "--frozn", "a"),
                                 r"unrecognized arguments: --frozn a; did you mean '--frozen'\?"),
    "misspelled-command": Mistake(("fitt",), r"invalid choice: 'fitt' \(choose from 'demo', 'export', 'inspect', "
                                             r"'fleet', 'fit', 'validate', 'test', 'predict'\); did you mean 'fit'\?"),
    "demo-out-file": Mistake(("demo", "--out", "notes.txt"), r"--out 'notes\.txt' is a file, but --out names the "
                             r"folder that receives artifacts/.*; pass a folder", {"notes.txt": b"mine"}),
    "export-out-file": Mistake((*FACTORY[:-1], "notes.txt", "--input-shape", "64"),
                               r"--out 'notes\.txt' is a file.*pass a folder", {"notes.txt": b"mine"}),
    "inspect-missing": Mistake(("inspect", "missing"), r"missing does not exist"),
    "inspect-junk": Mistake(("inspect", "junk"), r"junk is not an ONNX Runtime checkpoint; inspect reads",
                            {"junk": b"not a checkpoint"}),
    "inspect-lightning-ckpt": Mistake(("inspect", "last.ckpt"), r"last\.ckpt is a torch/Lightning checkpoint.*inspect "
                                      r"reads an artifacts folder.*ORT checkpoint file", {"last.ckpt": _torch_ckpt()}),
    # LightningCLI subcommands: caught after parsing, before any export, seed or process start
    "missing-artifacts": Mistake(_fit("--model.artifacts", "nothere", "--export.factory", "null"),
                                 r"model\.artifacts folder 'nothere' does not exist; add an export: section.*"
                                 r"ort-lightning export"),
    "misspelled-key": Mistake(_fit("--trainer.max_epocs", "3"),
                              r"unknown key 'trainer\.max_epocs'; did you mean 'trainer\.max_epochs'\?"),
    "misspelled-key-in-file": Mistake(("fit", "--config", "typo.yaml"),
                                      r"unknown key 'model\.lrr'; did you mean 'model\.lr'\? Valid keys under "
                                      r"'model': ",
                                      {"typo.yaml": CONFIG.read_bytes().replace(b"  lr: 0.01", b"  lrr: 0.01")}),
    "bad-value": Mistake(_fit("--model.lr", "fast"), r"bad value 'fast' for model\.lr: expected a float"),
    "misspelled-value": Mistake(_fit("--trainer.precision", "16-mixd"),
                                r"bad value '16-mixd' for trainer\.precision; did you mean '16-mixed'\? Valid values: "
                                r".*32-true"),
    "precision": Mistake(_fit("--trainer.precision", "16-mixed"),
                         r"--trainer\.precision '16-mixed' is not supported.*32-true"),
    "plain-ddp": Mistake(_fit("--trainer.strategy", "ddp", "--trainer.devices", "2"),
                         r"--trainer\.strategy 'ddp' cannot train ORT.*ort_ddp"),
    "misspelled-strategy": Mistake(_fit("--trainer.strategy", "ort_dpp"),
                                   r"unknown --trainer\.strategy 'ort_dpp'; did you mean 'ort_ddp'\?"),
    "misspelled-accelerator": Mistake(_fit("--trainer.accelerator", "cpus"),
                                      r"--trainer\.accelerator 'cpus' cannot run ORT graphs; did you mean 'cpu'\? "
                                      r"Valid values: auto, cpu, gpu"),
    "wrong-input-shape": Mistake(_fit("--export.input_shape", "[3, 32, 32]", "--model.artifacts", "fresh"),
                                 r"cannot run on inputs of shape \(batch, 3,32,32\).*export\.input_shape"),
    "bad-class-path": Mistake(_fit("--data", "foo.Bar"),
                              r"bad value 'foo\.Bar' for data: No module named 'foo'; name an importable class"),
    "no-last-checkpoint": Mistake(("validate", "--config", str(CONFIG), "--ckpt_path", "last"),
                                  r"--ckpt_path last found no last\.ckpt \(runs/digits/checkpoints\); run fit with "
                                  r"this config first"),
    "misspelled-ckpt-path": Mistake(("predict", "--config", str(CONFIG), "--ckpt_path", "lst"),
                                    r"--ckpt_path 'lst' is not a file; did you mean 'last'\?"),
    "no-config": Mistake(("fit",), r"required: fit\.model\.artifacts, fit\.data; pass --config cfg\.yaml"),
    "missing-config-file": Mistake(("validate", "--config", "nothere.yaml"),
                                   r"config file '.*nothere\.yaml' does not exist; pass --config"),
}


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Run every mistaken command once, a few at a time (each one mostly waits for its imports)."""

    def attempt(name: str) -> tuple[str, tuple[Path, subprocess.CompletedProcess[str]]]:
        folder = tmp_path_factory.mktemp(name)
        for file, content in MISTAKES[name].files.items():
            (folder / file).write_bytes(content)
        return name, (folder, run(*MISTAKES[name].args, cwd=folder, ok=False))

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(attempt, MISTAKES))


@pytest.mark.parametrize("name", list(MISTAKES))
def test_error_is_one_line_with_status_2(
    mistakes: dict[str, tuple[Path, subprocess.CompletedProcess[str]]], name: str
) -> None:
    folder, result = mistakes[name]
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-3000:]  # nothing else on stderr: no usage, no traceback
    assert result.stderr.startswith("ort-lightning: error: "), result.stderr
    assert re.search(MISTAKES[name].pattern, result.stderr), result.stderr
    assert not (folder / "runs").exists()  # refused before anything was exported or trained
