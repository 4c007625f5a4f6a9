"""Every notebook in notebooks/ is committed executed, and still executes from top to bottom.

Both use `tools.run_notebooks`, the script that re-runs notebooks; it saves the executed copies
apart, and rewrites the committed files only with ``--in-place``.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from tools.run_notebooks import NOTEBOOKS, ROOT, figures, main

pytestmark = pytest.mark.slow  # notebook kernels

PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
#: A committed figure beyond this is not a "modest" PNG any more (the script saves them at 60 dpi).
MAX_FIGURE_BYTES = 80_000


@pytest.mark.parametrize("path", PATHS, ids=[path.stem for path in PATHS])
def test_notebook_is_committed_executed_with_figures(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), f"{path.name}: run python -m tools.run_notebooks {path}"
    pngs = figures(notebook)
    assert pngs, f"{path.name} holds no figure"
    for png in pngs:
        data = base64.b64decode(png)
        assert data.startswith(b"\x89PNG")
        assert len(data) < MAX_FIGURE_BYTES
    text = path.read_text()
    for machine_path in (str(ROOT), tempfile.gettempdir(), sys.prefix, str(Path.home()), "site-packages"):
        named = len(machine_path) > 1 and machine_path in text
        assert not named, f"{path.name} names a path of the machine that ran it: {machine_path}"
    assert "Traceback" not in text


def _git_status_of_notebooks() -> str:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the notebooks' git status needs git and a git checkout")
    return subprocess.run(["git", "status", "--porcelain", "--", "notebooks/"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.mark.parametrize("path", PATHS, ids=[path.stem for path in PATHS])
def test_notebook_executes_and_draws_without_touching_the_committed_file(path: Path, tmp_path: Path) -> None:
    status, committed = _git_status_of_notebooks(), path.read_bytes()
    # raises CellExecutionError, with the cell and traceback, on any failure
    assert main([str(path), "--out", str(tmp_path)]) == 0
    executed = nbformat.read(tmp_path / path.name, as_version=4)
    assert figures(executed), f"{path.name} drew no figure"
    assert path.read_bytes() == committed
    assert _git_status_of_notebooks() == status
