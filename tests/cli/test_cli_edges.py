"""The console script as a user types it: factories beside the user's code, no abbreviated options."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ort_lightning import TrainingArtifacts
from ort_lightning.cli.console import main
from tests.helpers import ROOT

SCRIPT = Path(sys.executable).with_name("ort-lightning")
CONFIG = ROOT / "examples" / "digits.yaml"


@pytest.mark.slow  # the console script
def test_a_factory_in_the_current_folder_is_found_as_python_m_finds_it(tmp_path: Path) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("import torch\n\ndef make_model():\n    return torch.nn.Linear(4, 3)\n")
    result = subprocess.run(
        [str(SCRIPT), "export", "mypkg.models:make_model", "--input-shape", "4", "--out", "art"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert [spec.shape for spec in TrainingArtifacts.load(tmp_path / "art").manifest.inputs] == [("batch", 4)]


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("fit", "--config", str(CONFIG), "--trainer.max_epoch", "1"),
         r"^ort-lightning: error: fit: unknown key 'trainer\.max_epoch'; did you mean 'trainer\.max_epochs'\?"),
        (("export", "ort_lightning.demo:digits_mlp", "--out", "x", "--input-shap", "64"),
         r"^ort-lightning: error: ort-lightning: unrecognized arguments: --input-shap 64; did you mean "
         r"'--input-shape'\?"),
    ],
    ids=["lightning-cli-key", "export-option"],
)
def test_an_abbreviated_option_is_a_misspelling_not_a_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
    pattern: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert main(list(args)) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    assert re.search(pattern, error), error
    assert not (tmp_path / "runs").exists()
    assert not (tmp_path / "x").exists()
