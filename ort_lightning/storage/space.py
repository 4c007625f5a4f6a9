"""Free space before a write, and what a failed write says: the path, the cause, the sizes.

A write that runs out of space fails in three dialects: an ``OSError`` with ``errno`` 28 from
Python, ONNX Runtime's ``RuntimeError`` "... No space left on device errno:28" for a checkpoint,
and "Protobuf serialization failed" (no word of space) for an inference model. `write_failure`
turns each into one `StorageError` that names the file, says whether the disk is full, and
how much the write needed and found, measured while the partial file still holds its space.

Example::

    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> check_space(folder / "model.onnx", needed=1)
    >>> error = write_failure(folder / "model.onnx", OSError(28, "No space left on device"),
    ...                       written=0, needed=2**60)
    >>> str(error).startswith("No space left on device: writing")
    True
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ort_lightning.errors import StorageError

__all__ = ["check_space", "free_bytes", "size_of", "write_failure"]

_MB = 1 << 20
#: Below this much free space a failed write is taken for a full disk even when its error does not say so.
_NEARLY_FULL = _MB
#: Room kept besides the file itself: its sidecar digest, a folder entry, the file system's own blocks.
_SLACK = 64 << 10


def free_bytes(path: Path) -> int | None:
    """Bytes free on the file system that holds `path` (its nearest existing folder); None if unknown."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _mb(size: int) -> str:
    return f"{size / _MB:.1f} MB"


def _no_space_error(path: Path, needed: int | None, free: int | None) -> StorageError:
    need = f"needs ~{_mb(needed)}" if needed else "needs more room"
    have = f"{_mb(free)} free" if free is not None else "free space unknown"
    return StorageError(
        f"No space left on device: writing {path} {need}, {have} on that file system; the previous file at that "
        "path (if any) is intact and no partial file is left. Free some space there (old checkpoints, "
        "save_top_k), or write to another folder, then save again."
    )


def check_space(path: Path, *, needed: int | None) -> None:
    """Refuse a write of about `needed` bytes before it starts when the file system has less room.

    Raises:
        StorageError: naming the path, the size needed and the space free.
    """
    if not needed:
        return
    free = free_bytes(path)
    if free is not None and free < needed + _SLACK:
        raise _no_space_error(path, needed, free)


def _says_no_space(error: BaseException) -> bool:
    cause: BaseException | None = error
    while cause is not None:
        if getattr(cause, "errno", None) == errno.ENOSPC:
            return True
        text = str(cause)
        if "errno:28" in text or "No space left" in text:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def write_failure(path: Path, error: BaseException, *, written: int, needed: int | None) -> StorageError:
    """The package's error for a write of `path` that failed with `error`.

    Args:
        path: the file that was being written.
        error: what the writer raised.
        written: bytes the partial file held when the write failed (before it is removed).
        needed: the size the write was expected to reach, if known.
    """
    free = free_bytes(path)
    if _says_no_space(error) or (free is not None and free < _NEARLY_FULL):
        # NOTE: measured before the partial file is removed: it holds what the write could use.
        return _no_space_error(path, needed or (written + _SLACK if written else None), free)
    cause = " ".join(str(error).split())[:200] or type(error).__name__
    return StorageError(
        f"Could not write {path} ({type(error).__name__}: {cause}); the previous file at that path (if any) is intact "
        "and no partial file is left. Check that the folder exists and can be written, then save again."
    )


def size_of(path: Path) -> int | None:
    """The size of an existing file (what a replacement of it will about need), else None."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None
