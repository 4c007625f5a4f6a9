"""Execute notebooks top to bottom and save them with their outputs and figures.

Usage::

    python -m tools.run_notebooks                                  # every notebooks/*.ipynb, to runs/notebooks/
    python -m tools.run_notebooks notebooks/04_transformer_finetune.ipynb
    python -m tools.run_notebooks --out executed/                  # the executed copies go there
    python -m tools.run_notebooks --in-place                       # rewrite the committed notebooks
    python -m tools.run_notebooks --check                          # execute, save nothing

By default the executed copies go to `OUT` (``runs/notebooks/``, ignored by git), so that running a
notebook leaves the committed file untouched; ``--in-place`` rewrites it, which is how the committed
outputs are refreshed.

Each notebook runs in a fresh ``python3`` kernel whose working directory is a new temporary
folder, with this checkout first on ``PYTHONPATH``. Figures are PNGs at a modest resolution
(`DPI`). Before saving, text that names this machine (the checkout, the temporary folder,
the Python prefix, the home folder) is replaced by a placeholder, and the execution
timestamps are dropped, so that a re-run changes only what the code printed or drew.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
#: Where the executed copies go unless ``--out`` or ``--in-place`` says otherwise.
OUT = ROOT / "runs" / "notebooks"
#: Resolution of the PNG figures the notebooks store.
DPI = 60
_SETUP = f"%config InlineBackend.rc = {{'figure.dpi': {DPI}, 'savefig.dpi': {DPI}}}"


def _machine_paths(workdir: Path) -> list[tuple[str, str]]:
    pairs = [(str(workdir.resolve()), "<tmp>"), (str(workdir), "<tmp>"), (tempfile.gettempdir(), "<tmp>"),
             (str(ROOT), "<repo>"), (sys.prefix, "<python>"), (str(Path.home()), "~")]
    return sorted({(path, placeholder) for path, placeholder in pairs if len(path) > 1}, key=lambda p: -len(p[0]))


def _texts(notebook: nbformat.NotebookNode) -> Iterator[tuple[dict, str]]:
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                yield output, "text"
            for kind, value in output.get("data", {}).items():
                if kind.startswith("text/") and isinstance(value, str):
                    yield output["data"], kind
            if "traceback" in output:
                output["traceback"] = []


def scrub(notebook: nbformat.NotebookNode, workdir: Path) -> None:
    """Replace machine paths in text outputs by placeholders; drop execution timestamps."""
    pairs = _machine_paths(workdir)
    for holder, key in _texts(notebook):
        text = holder[key] if isinstance(holder[key], str) else "".join(holder[key])
        for path, placeholder in pairs:
            text = text.replace(path, placeholder)
        holder[key] = re.sub(r"<tmp>/[\w.-]+", "<tmp>", text)
    for cell in notebook.cells:
        cell.get("metadata", {}).pop("execution", None)


def execute(path: Path, workdir: Path, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Run the notebook at `path` in a fresh kernel inside `workdir`; return it with its outputs.

    Raises:
        nbclient.exceptions.CellExecutionError: with the failing cell and its traceback.
    """
    notebook = nbformat.read(path, as_version=4)
    setup = nbformat.v4.new_code_cell(_SETUP)
    notebook.cells.insert(0, setup)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    client = nbclient.NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", record_timing=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    notebook.cells.remove(setup)
    scrub(notebook, workdir)
    return notebook


def figures(notebook: nbformat.NotebookNode) -> list[str]:
    """The base64 PNG figures among the notebook's outputs."""
    return [
        output["data"]["image/png"]
        for cell in notebook.cells if cell.cell_type == "code"
        for output in cell.outputs if "image/png" in output.get("data", {})
    ]


def _destination(path: Path, args: argparse.Namespace) -> Path | None:
    """Where the executed `path` is saved: nowhere (``--check``), over itself (``--in-place``), or in ``--out``."""
    if args.check:
        return None
    return path if args.in_place else args.out / path.name


def main(argv: list[str] | None = None) -> int:
    """Execute the notebooks named (default: all) and save them with their outputs (see the module's usage)."""
    parser = argparse.ArgumentParser(prog="python -m tools.run_notebooks", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    saving = parser.add_mutually_exclusive_group()
    saving.add_argument("--out", type=Path, default=OUT, help=f"folder of the executed copies (default {OUT})")
    saving.add_argument("--in-place", action="store_true", help="save over the notebooks themselves")
    saving.add_argument("--check", action="store_true", help="execute only; do not save")
    args = parser.parse_args(argv)
    for path in args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb")):
        with tempfile.TemporaryDirectory(prefix="notebook-") as folder:
            notebook = execute(path, Path(folder))
        pngs = figures(notebook)
        kib = sum(len(png) * 3 // 4 for png in pngs) / 1024
        destination = _destination(path, args)
        if destination is not None:
            destination.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, destination)
        saved = "" if destination is None else f", saved to {destination}"
        print(f"{path.name}: executed, {len(pngs)} figure(s), {kib:.0f} KiB of PNG{saved}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
