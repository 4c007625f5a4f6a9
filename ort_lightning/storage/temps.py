"""This package's temporary files: their names, and the clean-up that touches nothing else.

Each is named ``.<name>.ort-lightning-<pid>-<random>.tmp``, so that `remove_stale_temps` removes
the leftovers of dead processes and never a user's hidden ``.notes.tmp``.

Example::

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / ".notes.tmp").write_text("mine")
    >>> _ = (folder / ".last.ortckpt.ort-lightning-999999999-k2j1.tmp").write_bytes(b"partial")
    >>> [path.name for path in remove_stale_temps(folder)]
    ['.last.ortckpt.ort-lightning-999999999-k2j1.tmp']
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

from ort_lightning.errors import CheckpointError

__all__ = ["COMPANION_SUFFIXES", "TEMP_MARK", "TEMP_SUFFIX", "check_writable", "remove_stale_temps", "temp_prefix"]

TEMP_SUFFIX = ".tmp"
#: What marks a temporary file as this package's: ``.<name>.ort-lightning-<pid>-<random>.tmp``.
TEMP_MARK = ".ort-lightning-"
#: Files a writer may put beside its own: ONNX Runtime's external data of a checkpoint over 2 GB.
COMPANION_SUFFIXES = (".data",)
_TEMP_NAME = re.compile(
    rf"^\..+{re.escape(TEMP_MARK)}(?P<pid>\d+)-[^.]+{re.escape(TEMP_SUFFIX)}"
    rf"({'|'.join(map(re.escape, COMPANION_SUFFIXES))})?$"
)


def temp_prefix(name: str) -> str:
    """The start of a temporary file's name for the file `name`, in this process."""
    return f".{name}{TEMP_MARK}{os.getpid()}-"


def _alive(pid: int) -> bool:
    """Whether the process that named a temporary file may still be writing it."""
    if pid == os.getpid():
        return False  # NOTE: this process's own temps are stale once it looks: none of its writes is in flight
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: a process of another user holds that pid
        return True
    return True


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete what an interrupted `atomic_write` of a process now gone left in `folder` (the package's names only)."""
    if not folder.is_dir():
        return []
    stale = []
    for candidate in folder.iterdir():
        match = _TEMP_NAME.match(candidate.name)
        if match and candidate.is_file() and not _alive(int(match["pid"])):
            stale.append(candidate)
    for temp in stale:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    return stale


def check_writable(folder: Path) -> None:
    """Create `folder` and prove a file can be written there, before any step (`CheckpointError`)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=temp_prefix("write-probe"), suffix=TEMP_SUFFIX):
            pass
    except OSError as error:
        raise CheckpointError(
            f"Cannot write checkpoints to {folder} ({error.strerror or error}); it must be a folder you can write "
            "to: pass another `dirpath`, or fix that path's permissions, before training starts."
        ) from error
