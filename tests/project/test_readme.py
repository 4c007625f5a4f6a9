"""Every Python block of the README runs as written: in order, as one script, in an empty folder.

The README's blocks are read and run as the documentation pages' are (`tests.project.code_blocks`); its
first block is the quick start, the same as docs/index.md's (tests/project/test_docs_pages.py checks it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.project.code_blocks import README, PageRun, python_blocks, python_fences


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = python_blocks(README)
    assert blocks, "the README has no Python block"
    assert python_fences(README) == len(blocks), "a Python block of the README that this test cannot read"
    assert blocks[0].script is None
    assert "train_loader" in blocks[0].code


@pytest.mark.slow  # child processes; the README's own models, verified as the README exports them
def test_every_readme_python_block_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    run = PageRun(README, tmp_path)
    try:
        run.through(len(run.blocks) - 1)
    finally:
        run.close()
    assert (tmp_path / "artifacts" / "training_model.onnx").is_file()
