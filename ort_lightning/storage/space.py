"""Free space before a write, and what a failed write says: the path, the cause, the sizes.

A full disk fails in three dialects (``OSError`` 28, ORT's ``RuntimeError`` "errno:28", protobuf's
"serialization failed"); `write_failure` turns each into one `StorageError` with the sizes.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ort_lightning.errors import StorageError

__all__ = ["check_space", "folder_space_failure", "free_bytes", "size_of", "write_failure"]

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


_FILE_OUTCOME = (
    "the previous file at that path (if any) is intact and no partial file is left. Free some space there (old "
    "checkpoints, save_top_k), or write to another folder, then save again."
)
_FOLDER_OUTCOME = (
    "the files already in that folder are as they were and no partial or temporary file is left. Free some space "
    "there, or pass another output folder, then export again."
)


def _no_space_error(path: Path, needed: int | None, free: int | None, *, folder: bool = False) -> StorageError:
    need = f"needs ~{_mb(needed)}" if needed else "needs more room"
    have = f"{_mb(free)} free" if free is not None else "free space unknown"
    outcome = _FOLDER_OUTCOME if folder else _FILE_OUTCOME
    return StorageError(f"No space left on device: writing {path} {need}, {have} on that file system; {outcome}")


def check_space(path: Path, *, needed: int | None, folder: bool = False) -> None:
    """Refuse a write of about `needed` bytes to `path` (a `folder` if so) before it starts, when space is short.

    Raises:
        StorageError: naming the path, the size needed and the space free.
    """
    if not needed:
        return
    # NOTE: a folder's files land inside it, and it may be a mount point of its own (its parent is not).
    free = free_bytes(path / "_" if folder else path)
    if free is not None and free < needed + _SLACK:
        raise _no_space_error(path, needed, free, folder=folder)


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
    """The package's error for a write of `path` that failed with `error`, with `written` and `needed` bytes."""
    free = free_bytes(path)
    if _says_no_space(error) or (free is not None and free < _NEARLY_FULL):
        # NOTE: measured before the partial file is removed: it holds what the write could use.
        return _no_space_error(path, needed or (written + _SLACK if written else None), free)
    cause = " ".join(str(error).split())[:200] or type(error).__name__
    return StorageError(
        f"Could not write {path} ({type(error).__name__}: {cause}); the previous file at that path (if any) is intact "
        "and no partial file is left. Check that the folder exists and can be written, then save again."
    )


def folder_space_failure(
    folder: Path, error: BaseException, *, written: int, needed: int | None, writes: tuple[type[BaseException], ...]
) -> StorageError | None:
    """The package's error for a folder not written for want of space, else None (the caller's to raise).

    `writes` are the error types a writer raises; a nearly full disk explains only those.
    """
    free = free_bytes(folder / "_")  # NOTE: inside it: the folder may be a mount point of its own
    chain = _causes(error)
    nearly_full = free is not None and free < _NEARLY_FULL and any(isinstance(cause, writes) for cause in chain)
    if not (_says_no_space(error) or nearly_full):
        return None
    # NOTE: measured before the partial files are removed: they hold what the write could use. What the
    # writers managed is a floor of the size when the estimate missed part of it (a graph's constants).
    return _no_space_error(folder, max(needed or 0, written + _SLACK if written else 0) or None, free, folder=True)


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def size_of(path: Path) -> int | None:
    """The size of an existing file (what a replacement of it will about need), else None."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None
