"""Docstrings stay at most 0.35 of the package's code lines (`python -m tools.prose` prints the table)."""

from __future__ import annotations

from pathlib import Path

from tools.prose import PACKAGE, measure, measure_tree

#: Issue 49, item 6: docstring lines per code line across ``ort_lightning/``, doctests included.
LIMIT = 0.35

SAMPLE = '''"""A module docstring
on two lines."""

# a comment
import os  # a trailing comment keeps the line code


def f(x):
    """One line."""
    text = """not a docstring,
    but a string: code"""
    return x


class C:
    """Two

    lines and a blank."""
'''


def test_measure_counts_a_sample_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE, encoding="utf-8")
    prose = measure(path)
    # docstrings: lines 1-2, 9 and 16-18 (a docstring's blank line 17 counts: it is prose too);
    # code: import, def, text (2 lines), return, class.
    assert (prose.docstring, prose.code) == (6, 6)


def test_package_docstrings_are_at_most_the_limit_of_its_code() -> None:
    files, total = measure_tree(PACKAGE)
    worst = ", ".join(f"{f.path} {f.ratio:.2f}" for f in files[:5])
    assert total.ratio <= LIMIT, (
        f"docstrings are {total.ratio:.2f} of the package's code lines ({total.docstring} / {total.code}), "
        f"above {LIMIT}; shorten them (worst: {worst}; python -m tools.prose lists every file)"
    )
