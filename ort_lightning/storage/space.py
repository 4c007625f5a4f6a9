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
    """Refuse a write of about `needed` bytes before it starts when the file system has less room.

    Args:
        path: the file (or, with `folder`, the folder of files) to be written.
        needed: bytes the write will about take; None or 0 checks nothing.
        folder: word the error for a folder written as a whole (an export) rather than one file.

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


def folder_space_failure(
    folder: Path, error: BaseException, *, written: int, needed: int | None, writes: tuple[type[BaseException], ...]
) -> StorageError | None:
    """The package's error for a folder whose files could not all be written for want of space, else None.

    Unlike `write_failure`, any other failure stays the caller's to raise as it was: a stage that
    writes a folder also fails for reasons that have nothing to do with the disk.

    Args:
        folder: the folder that was being written.
        error: what a writer of it raised.
        written: bytes its partial files held when the write failed (before they are removed).
        needed: the size the folder was expected to reach, if known.
        writes: the error types a writer raises (a full disk may say nothing of space: protobuf's
            "Protobuf serialization failed"); a nearly full disk explains only those.
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
