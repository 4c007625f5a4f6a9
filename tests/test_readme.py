"""Every Python block of the README runs as written: in order, as one script, in an empty folder.

A block fenced as ``python train.py`` is a script of its own (the DDP launcher starts it again
once per rank): it is written to that file after the README's first block and run by Python.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python(?: (\S+))?\n(.*?)^```$", re.S | re.M)


def _blocks() -> list[tuple[str | None, str]]:
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(README.read_text(encoding="utf-8"))]


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = _blocks()
    assert len(blocks) >= 5
    assert blocks[0][0] is None
    assert "train_loader" in blocks[0][1]


@pytest.mark.slow  # child processes; the README's own models, verified as the README exports them
def test_every_readme_python_block_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    blocks = _blocks()
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for index, (script, code) in enumerate(blocks):
        if script is None:
            exec(compile(code, f"README.md python block {index}", "exec"), namespace)  # noqa: S102 - the README's code
            continue
        (tmp_path / script).write_text(f"{blocks[0][1]}\n{code}", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, f"README block {index} ({script}):\n{result.stderr[-3000:]}"
    assert (tmp_path / "checkpoints" / "last.ortckpt").is_file()
    assert (tmp_path / "model.onnx").is_file()
    assert (tmp_path / "rounds" / "last.ortckpt").is_file()
