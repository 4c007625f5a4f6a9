"""The code blocks of the README and of the pages under docs/: read them, run them as written.

- `python_blocks` reads a page's ```` ```python ```` blocks, in order.
- `PageRun` runs a page's blocks in order, as one script, in an empty folder of its own: each block
  uses the names the blocks before it define. A page that opens with the note `CONTINUES` runs the
  quick start's block first (the first Python block of docs/index.md), and uses its names.
- A block fenced ```` ```python title="train.py" ```` is a script of its own (the DDP launcher starts it
  again once per rank): the quick start's block followed by it, written to that file and run by Python.

Shell, JavaScript and TOML blocks are not run here; the tests that run them read them from their pages
(tests/test_fleet_deployment.py, tests/test_web_runner.py).
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
#: The page whose first Python block is the quick start that other pages continue.
QUICK_START_PAGE = DOCS / "index.md"
#: The note a page opens with when its code continues the quick start's.
CONTINUES = '!!! note "Continues the quick start"'
FENCE = re.compile(r'^```python(?: title="([^"]+)")?\n(.*?)^```$', re.S | re.M)
#: Every line that opens a Python block, however it is fenced or indented: `FENCE` must read each one.
ANY_PYTHON_FENCE = re.compile(r"^\s*```\s*(python|py|pycon)\b", re.M)
#: A line that includes another file, or one section of it, as mkdocs' pymdownx.snippets does.
SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"$', re.M)


@dataclass(frozen=True)
class Block:
    """One Python block of a page."""

    page: str
    index: int
    line: int
    code: str
    script: str | None

    @property
    def name(self) -> str:
        return f"{self.page} python block {self.index} (line {self.line})"


def page_name(path: Path) -> str:
    """How the tests name a page: its path from the repository root."""
    return path.relative_to(ROOT).as_posix()


def docs_pages() -> list[Path]:
    """Every Markdown page of the documentation site."""
    return sorted(DOCS.rglob("*.md"))


def _section(text: str, name: str) -> str:
    start, end = f"--8<-- [start:{name}]", f"--8<-- [end:{name}]"
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i, line in enumerate(lines) if end in line)
    return "".join(lines[first + 1 : last])


def page_text(path: Path) -> str:
    """The page as the site renders it: each snippet line replaced by what it includes (one level).

    Line numbers of a page with snippets count in this text, not in the file.
    """

    def include(match: re.Match[str]) -> str:
        text = (ROOT / match.group(1)).read_text(encoding="utf-8")
        return (_section(text, match.group(2)) if match.group(2) else text).rstrip("\n")

    return SNIPPET.sub(include, path.read_text(encoding="utf-8"))


def python_blocks(path: Path) -> list[Block]:
    """The page's Python blocks, in order."""
    text = page_text(path)
    return [
        Block(page_name(path), index, text.count("\n", 0, match.start()) + 1, match.group(2), match.group(1))
        for index, match in enumerate(FENCE.finditer(text))
    ]


def python_fences(path: Path) -> int:
    """How many Python blocks the page opens, counted apart from `FENCE`."""
    return len(ANY_PYTHON_FENCE.findall(page_text(path)))


def continues_the_quick_start(path: Path) -> bool:
    return CONTINUES in page_text(path)


def quick_start() -> Block:
    return python_blocks(QUICK_START_PAGE)[0]


@dataclass
class PageRun:
    """One page's blocks, run in order in `folder`: its namespace, how many have run, the first failure."""

    path: Path
    folder: Path
    blocks: list[Block] = field(init=False)
    prelude: Block | None = field(init=False)
    namespace: dict[str, object] = field(init=False)
    done: int = 0
    failure: str | None = None
    _prelude_ran: bool = False

    def __post_init__(self) -> None:
        self.blocks = python_blocks(self.path)
        self.prelude = quick_start() if continues_the_quick_start(self.path) else None
        self.namespace = {"__name__": "__docs__"}

    def through(self, index: int) -> None:
        """Run the blocks up to `index`, those not run yet; an AssertionError names the block that failed."""
        assert self.failure is None, f"an earlier block failed: {self.failure}"
        while self.done <= index:
            block = self.blocks[self.done]
            try:
                self._run(block)
            except BaseException as error:
                self.failure = f"{block.name}: {type(error).__name__}: {error}"
                raise
            self.done += 1

    def close(self) -> None:
        """Drop what the blocks made (ORT sessions included) now, not at interpreter exit."""
        self.namespace.clear()
        gc.collect()

    def _run(self, block: Block) -> None:
        if block.script is not None:
            self._run_script(block)
            return
        if self.prelude is not None and not self._prelude_ran:
            exec(compile(self.prelude.code, self.prelude.name, "exec"), self.namespace)  # noqa: S102 - the page's code
            self._prelude_ran = True
        exec(compile(block.code, block.name, "exec"), self.namespace)  # noqa: S102 - the page's code

    def _run_script(self, block: Block) -> None:
        assert block.script is not None
        prelude = self.prelude.code if self.prelude is not None else ""
        (self.folder / block.script).write_text(f"{prelude}\n{block.code}", encoding="utf-8")
        result = subprocess.run(
            [sys.executable, block.script], cwd=self.folder, capture_output=True, text=True, timeout=600, check=False
        )
        assert result.returncode == 0, f"{block.name} ({block.script}):\n{result.stderr[-3000:]}"
