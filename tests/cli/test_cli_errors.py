"""Every mistake on the console script's command line: one error line, status 2, nothing exported or trained.

The cases run ``main`` in this process (the console script's entry point, what it returns is the
exit status); tests/cli/test_cli.py runs a few of them as the installed console script in a child process.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ort_lightning.cli.console import ERROR_PREFIX, main
from tests.cli.mistakes import MISTAKES


@pytest.mark.parametrize("name", list(MISTAKES))
def test_error_is_one_line_with_status_2(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for file, content in MISTAKES[name].files.items():
        (tmp_path / file).write_bytes(content)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    status = main(list(MISTAKES[name].args))
    error = capsys.readouterr().err
    assert status == 2, error[-2000:]
    assert error.count("\n") == 1, error[-3000:]  # nothing else on stderr: no usage, no traceback
    assert error.startswith(ERROR_PREFIX), error
    assert re.search(MISTAKES[name].pattern, error), error
    assert not (tmp_path / "runs").exists()  # refused before anything was exported or trained
