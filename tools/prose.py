"""How much of the package is docstring: docstring lines over code lines, per file and in total.

Run as ``python -m tools.prose [folder] [--top N]``. A docstring line is a line of a module's,
class's or function's docstring (doctests and its blank lines included: the measure the
issue that set the limit used); a code line is a non-blank line that is
neither a comment nor a docstring. Files are read with ``ast``, never imported.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ort_lightning"


@dataclass(frozen=True)
class Prose:
    """The docstring and code lines of one file, or of several summed."""

    path: str
    docstring: int
    code: int

    @property
    def ratio(self) -> float:
        """Docstring lines per code line (0 for a file without code)."""
        return self.docstring / self.code if self.code else 0.0


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def _comment_lines(source: str) -> set[int]:
    """Lines whose only token is a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    code: set[int] = set()
    comments: set[int] = set()
    ignored = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokens:
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in ignored:
            code.update(range(token.start[0], token.end[0] + 1))
    return comments - code


def measure(path: Path, *, name: str | None = None) -> Prose:
    """Count one Python file's docstring and code lines."""
    source = path.read_text(encoding="utf-8")
    docstrings = _docstring_lines(ast.parse(source))
    comments = _comment_lines(source)
    blank = {number for number, line in enumerate(source.splitlines(), 1) if not line.strip()}
    total = len(source.splitlines())
    code = total - len(docstrings | comments | blank)
    return Prose(name or str(path), len(docstrings), code)


def measure_tree(root: Path, *, exclude: tuple[str, ...] = ()) -> tuple[list[Prose], Prose]:
    """Every ``.py`` file under ``root`` (worst first) and their sum, skipping ``exclude`` subfolders."""
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if any(relative == part or relative.startswith(part.rstrip("/") + "/") for part in exclude):
            continue
        files.append(measure(path, name=relative))
    files.sort(key=lambda prose: prose.ratio, reverse=True)
    total = Prose("total", sum(f.docstring for f in files), sum(f.code for f in files))
    return files, total


def main(argv: list[str] | None = None) -> int:
    """Print the table, worst files first, and the total."""
    parser = argparse.ArgumentParser(prog="python -m tools.prose", description=__doc__)
    parser.add_argument("root", nargs="?", type=Path, default=PACKAGE)
    parser.add_argument("--top", type=int, default=0, help="print only the N worst files")
    parser.add_argument("--exclude", action="append", default=[], help="a subfolder to leave out")
    args = parser.parse_args(argv)
    files, total = measure_tree(args.root, exclude=tuple(args.exclude))
    shown = files[: args.top] if args.top else files
    print(f"{'ratio':>6} {'doc':>5} {'code':>5}  file")
    for prose in [*shown, total]:
        print(f"{prose.ratio:6.2f} {prose.docstring:5d} {prose.code:5d}  {prose.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
