"""The console script as a user runs it (a child process), its example config, and the digits run checked in torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import ROOT

SCRIPT = Path(sys.executable).with_name("ort-lightning")
CONFIG = ROOT / "examples" / "digits.yaml"


def run_script(*args: object, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def digits_labels() -> torch.Tensor:
    from ort_lightning.demo import DigitsDataModule

    data = DigitsDataModule()
    data.setup("predict")
    return data.val_set.tensors[1]


def torch_accuracy_of(ckpt: Path) -> float:
    """The held-out digits' accuracy of the .ckpt's weights in the plain torch model, computed here."""
    from ort_lightning.demo import DigitsDataModule, digits_mlp

    model = digits_mlp()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"], strict=False)
    data = DigitsDataModule()
    data.setup("validate")
    images, labels = data.val_set.tensors
    with torch.no_grad():
        return float((model(images).argmax(dim=1) == labels).float().mean())


def metric(name: str, shown: str) -> float:
    """A metric's value from Lightning's results table."""
    return float(re.search(rf"{name}\W+([\d.]+)", shown).group(1))  # type: ignore[union-attr]
