"""What an export leaves of the user's logging, and what it prints: nothing of ONNX Runtime's own.

Each case runs in a child process: an import that another test made earlier would hide a handler
added at import time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # child processes, the console script

SCRIPT = Path(sys.executable).with_name("ort-lightning")

#: A child that sets up (or not) the root logger as a user would, imports the package, exports a tiny
#: model with every optional file (.ort graphs, nominal checkpoint, verification), and reports the
#: root logger before and after, and every record a handler of the user's received.
_CHILD = textwrap.dedent(
    """
    import json, logging, sys
    import torch

    root = logging.getLogger()
    received = []
    if sys.argv[2] == "configured":
        handler = logging.StreamHandler(sys.stdout)
        handler.emit = lambda record: received.append(f"{record.name}: {record.getMessage()}")
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    before = {"handlers": [repr(h) for h in root.handlers], "level": root.level}
    from ort_lightning import export_artifacts

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    export_artifacts(model, torch.zeros(2, 4), sys.argv[1], ort_format=True, nominal_checkpoint=True)
    after = {"handlers": [repr(h) for h in root.handlers], "level": root.level}
    print("REPORT " + json.dumps({"before": before, "after": after, "received": received}))
    """
)


def _export_in_child(folder: Path, setup: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), setup], capture_output=True, text=True, cwd=ROOT,
        timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    printed = result.stdout.replace(line, "") + result.stderr
    return json.loads(line.removeprefix("REPORT ")), printed


@pytest.mark.parametrize("setup", ["unconfigured", "configured"], ids=["no-handler", "user-handler-at-info"])
def test_export_leaves_the_root_logger_as_it_was_and_prints_nothing_of_ort(tmp_path: Path, setup: str) -> None:
    report, printed = _export_in_child(tmp_path / "artifacts", setup)
    assert report["after"] == report["before"]
    expected_handlers = 0 if setup == "unconfigured" else 1
    assert len(report["before"]["handlers"]) == expected_handlers
    # ORT's generator ("Saved training model to ...") and converter ("Created config in ...") log at INFO
    ort_lines = [line for line in report["received"] if re.search(r"Saved |Created config|block provided", line)]
    assert ort_lines == []
    assert not re.search(r"^INFO|\[INFO\]|Created config", printed, re.MULTILINE), printed
    assert sorted(p.name for p in (tmp_path / "artifacts").glob("*.required_operators.config")) == [
        "eval_model.required_operators.config", "optimizer_model.required_operators.config",
        "training_model.required_operators.config",
    ]


def _console(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False)


def test_console_export_with_ort_format_prints_no_ort_info_lines(tmp_path: Path) -> None:
    export = ("export", "ort_lightning.demo:digits_mlp", "--input-shape", "64", "--nominal-checkpoint", "--ort-format",
              "--out", str(tmp_path / "device"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        result, shown_help = pool.map(lambda args: _console(*args, cwd=tmp_path), [export, ("--help",)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert shown_help.returncode == 0, shown_help.stderr[-3000:]
    # only what importing prints (nothing with this torch), as --help shows it: the export adds nothing
    assert result.stderr == shown_help.stderr
    assert "INFO" not in result.stdout
    assert (tmp_path / "device" / "training_model.ort").is_file()
