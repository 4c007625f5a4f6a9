"""The layout: tests in a folder per part of the package, no test module imported by another, no twin file names.

Shared fixtures live in a folder's ``conftest.py``, shared checks and data in helper modules (any name
but ``test_*.py``). A test module imported by another ties the two files together (one's private helper
becomes the other's dependency), and its fixtures come over as imports whose redefinition ruff must be
told to ignore (F811); both are refused here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

TESTS = ROOT / "tests"
PYTHON = sorted(path for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imported(path: Path) -> list[tuple[int, str]]:
    """Each module that `path` imports, by line, relative imports resolved against its package."""
    package = _module(path).rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            # a name imported from a package may be a test module of it: counted as an import of that module
            found += [(node.lineno, base), *((node.lineno, f"{base}.{alias.name}") for alias in node.names)]
    return found


def test_no_module_under_tests_imports_a_test_module() -> None:
    offences = [f"{path.relative_to(ROOT)}:{line} imports {name}"
                for path in PYTHON for line, name in _imported(path)
                if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    assert not offences, "move what they share into a conftest.py or a helper module:\n" + "\n".join(offences)


def test_no_redefinition_is_hidden_from_ruff() -> None:
    hidden = [f"{path.relative_to(ROOT)}:{number}" for path in PYTHON
              for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
              if re.search(r"#\s*noqa:[^#]*\bF811\b", line)]
    assert not hidden, "a fixture comes from a conftest.py, not from an import it redefines:\n" + "\n".join(hidden)


def test_each_test_module_lives_in_the_folder_of_what_it_tests() -> None:
    flat = [path.name for path in TESTS.glob("test_*.py")]
    assert not flat, f"put {flat} in the folder of tests/ that mirrors the part of the package they test"


def test_each_folder_is_a_package() -> None:
    # NOTE: without it, two test files of one basename in two folders collide under pytest's rootdir imports.
    bare = sorted(str(folder.relative_to(ROOT)) for folder in {path.parent for path in PYTHON}
                  if not (folder / "__init__.py").is_file())
    assert not bare, f"{bare} need an __init__.py"


def test_no_two_modules_of_the_package_share_a_file_name() -> None:
    # A file name says what the module is wherever it stands: two `state.py` send a reader to the wrong room.
    names: dict[str, list[str]] = {}
    for path in (ROOT / "ort_lightning").rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in names.items() if len(paths) > 1} == {}
