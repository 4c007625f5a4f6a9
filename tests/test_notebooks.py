"""Every notebook in notebooks/ executes from top to bottom and draws its figures."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _outputs(notebook: nbformat.NotebookNode, kind: str) -> list[object]:
    return [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if kind in output.get("data", {})
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_executes_and_draws(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any failure
    assert _outputs(notebook, "image/png"), f"{path.name} drew no figure"
