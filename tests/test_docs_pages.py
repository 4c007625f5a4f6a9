"""Every Python block of every page under docs/ runs as written, page by page, block by block.

How a page's blocks run is `tests.code_blocks`' docstring: in order, as one script, in an empty
folder of the page's own, after the quick start's block where the page says it continues it. Each
block is a test of its own (``docs/guide/checkpoints.md-block0``); a block runs the blocks before it
that have not run yet, so that ``-k`` can pick any one of them. Scripts (```` ```python title="train.py" ````)
start processes of their own, DDP ranks among them: those are slow, and so are the blocks of `SLOW_BLOCKS`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest

from tests.code_blocks import (
    DOCS,
    QUICK_START_PAGE,
    README,
    Block,
    PageRun,
    continues_the_quick_start,
    docs_pages,
    page_name,
    python_blocks,
    python_fences,
    quick_start,
)

#: What a page's blocks leave in its folder once they have all run: the proof that they did their work.
WRITES = {
    "docs/index.md": ("artifacts/training_model.onnx",),
    "docs/guide/checkpoints.md": ("checkpoints/last.ortckpt", "model.onnx"),
    "docs/guide/ddp.md": ("artifacts/training_model.onnx",),
    "docs/fleets.md": ("rounds/last.ortckpt", "device.ortckpt"),
}

#: The modules whose public names (their ``__all__``) the API reference pages must render.
PUBLIC_MODULES = ("ort_lightning", "ort_lightning.errors", "ort_lightning.fleet", "ort_lightning.fleet.engines.browser",
                  "ort_lightning.web")

#: In-process blocks that take more than about 10 s on an idle 2-core machine, and why (scripts are always slow).
SLOW_BLOCKS = {
    "docs/guide/huggingface.md-block3": "exports and verifies a BERT and a GPT-2: about 11 s with the quick start",
}

_BLOCKS = [block for path in docs_pages() for block in python_blocks(path)]


def _id(block: Block) -> str:
    return f"{block.page}-block{block.index}"


def _param(block: Block) -> object:
    slow = block.script is not None or _id(block) in SLOW_BLOCKS
    return pytest.param(block, id=_id(block), marks=[pytest.mark.slow] if slow else [])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PageRun]]:
    started: dict[str, PageRun] = {}
    yield started
    for run in started.values():
        run.close()


@pytest.mark.parametrize("block", [_param(block) for block in _BLOCKS])
def test_docs_python_block_runs_as_written(
    block: Block, runs: dict[str, PageRun], tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = DOCS.parent / block.page
    if block.page not in runs:
        runs[block.page] = PageRun(path, tmp_path_factory.mktemp(path.stem))
    run = runs[block.page]
    monkeypatch.chdir(run.folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    if run.failure is not None:
        pytest.skip(f"an earlier block of the page failed: {run.failure}")
    run.through(block.index)
    if block.index == len(run.blocks) - 1:
        missing = [name for name in WRITES.get(block.page, ()) if not (run.folder / name).exists()]
        run.close()
        assert not missing, f"{block.page}'s blocks ran but did not write {missing}"


def test_the_pages_hold_the_blocks_this_test_runs() -> None:
    pages = {page_name(path): path for path in docs_pages()}
    assert "train_loader" in quick_start().code
    assert set(WRITES) <= set(pages), sorted(set(WRITES) - set(pages))
    for name, path in pages.items():
        # a Python block fenced otherwise (indented, other options) would silently never run
        assert python_fences(path) == len(python_blocks(path)), f"{name}: a Python block this test cannot read"
        if continues_the_quick_start(path):
            assert path != QUICK_START_PAGE, "the quick start cannot continue itself"
            assert python_blocks(path), f"{name} continues the quick start with no code"
    assert set(SLOW_BLOCKS) <= {_id(block) for block in _BLOCKS}, "SLOW_BLOCKS names a block that is gone"
    scripts = [block for block in _BLOCKS if block.script is not None]
    assert scripts, "the DDP page's train.py is the one script of the pages"
    assert all(continues_the_quick_start(DOCS.parent / block.page) for block in scripts)


def test_the_docs_quick_start_is_the_readme_quick_start_included() -> None:
    # docs/index.md includes the README's block (pymdownx.snippets) rather than a copy of it
    assert '--8<-- "README.md:quick-start"' in QUICK_START_PAGE.read_text(encoding="utf-8")
    assert python_blocks(README)[0].code == quick_start().code


def _rendered_names() -> set[str]:
    """What the ``:::`` directives of the reference pages render: a module stands for its whole ``__all__``."""
    names: set[str] = set()
    for path in sorted((DOCS / "reference").glob("*.md")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.startswith("::: "):
                continue
            target = line.removeprefix("::: ").strip()
            try:
                module = importlib.import_module(target)
            except ImportError:
                module_name, _, name = target.rpartition(".")
                names.add(f"{module_name}.{name}")
                continue
            names |= {f"{target}.{name}" for name in module.__all__}
    return names


def test_the_api_reference_renders_every_public_name() -> None:
    pytest.importorskip("flwr", reason='the fleet\'s names need Flower: pip install -e ".[fleet]"')
    rendered = _rendered_names()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        missing = {f"{module_name}.{name}" for name in module.__all__ if name != "__version__"} - rendered
        assert not missing, f"docs/reference/ renders no {sorted(missing)}: add a ::: line for each"
