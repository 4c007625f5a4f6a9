"""The example configs through the ``ort-lightning`` console script's LightningCLI subcommands.

They run the console script's `main` in this process: a child would pay Lightning's import (about 5 s of CPU)
for each run. tests/cli/test_cli.py runs the installed script itself (``demo``, ``export``, ``fit``);
tests/cli/test_cli_output.py runs docs/cli.md's commands, the digits config's ``fit``, resume, ``validate``,
``test`` and ``predict`` among them, and checks what they print and compute.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ort_lightning.cli import main
from tests.cli.script import CONFIG
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # LightningCLI runs that train

CNN_CONFIG = ROOT / "examples" / "stripes_cnn.yaml"


@dataclass
class Printed:
    """What one run of the console script printed."""

    stdout: str
    stderr: str


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> object:
    """``run(*args, cwd=folder)``: the console script's `main` in `folder`; its exit status must be 0."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the current folder first, as `python -m` does

    def run_main(*args: object, cwd: Path) -> Printed:
        monkeypatch.chdir(cwd)
        with warnings.catch_warnings(record=True) as caught:  # a child prints them on stderr
            warnings.simplefilter("always")
            status = main([str(arg) for arg in args])
        out, err = capsys.readouterr()
        printed = Printed(out, err + "".join(f"{warning.message}\n" for warning in caught))
        assert status == 0, printed.stderr[-3000:]
        return printed

    return run_main


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits artifacts, exported in this process: print_config only names the folder."""
    from ort_lightning import export_artifacts
    from ort_lightning.demo import digits_mlp

    folder = tmp_path_factory.mktemp("cli") / "art"
    export_artifacts(digits_mlp(), torch.zeros(2, 64), folder, verify=False)
    return folder


def test_cnn_config_trains_as_written(run: Any, tmp_path: Path) -> None:
    tiny = ["--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false"]
    fit = run("fit", "--config", CNN_CONFIG, *tiny, cwd=tmp_path)
    assert "exported ort_lightning.demo:stripes_cnn" in fit.stdout
    test = run("test", "--config", CNN_CONFIG, *tiny, "--ckpt_path", "last", cwd=tmp_path)
    test_loss = float(re.search(r"test_loss\W+([\d.]+)", test.stdout).group(1))  # type: ignore[union-attr]
    assert test_loss < math.log(4) - 0.3  # 4 classes: ln(4) = 1.39 untrained


def test_lightning_cli_print_config(
    digits_artifacts: Path, tmp_path: Path, run: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as printed:  # jsonargparse exits after printing the config
        run("fit", "--config", CONFIG, "--model.artifacts", digits_artifacts, "--print_config", cwd=tmp_path)
    assert printed.value.code in (0, None)
    result = Printed(*capsys.readouterr())
    assert f"artifacts: {digits_artifacts}" in result.stdout
    assert "class_path: ort_lightning.demo.DigitsDataModule" in result.stdout
    config = yaml.safe_load(result.stdout)
    assert "optimizer" not in config
    assert "lr_scheduler" not in config
    assert config["export"]["factory"] == "ort_lightning.demo:digits_mlp"


