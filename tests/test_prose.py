"""Docstrings stay at most 0.35 of the package's code lines (`python -m tools.prose` prints the table)."""

from __future__ import annotations

from pathlib import Path

from tools.prose import measure

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
    # docstrings: lines 1-2, 9, 16 and 18 (the blank line 17 is not counted);
    # code: import, def, text (2 lines), return, class.
    assert (prose.docstring, prose.code) == (5, 6)

