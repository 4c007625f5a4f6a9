"""Atomic, verified file writes: a crash at any instant leaves the previous file intact.

A file is written under a temporary name beside it, flushed, then renamed over the target. A
``<name>.sha256`` sidecar lists the digests the file may have (both, while a replacement is in
flight), so a truncated file verifies as neither. Companions (ORT's ``path.data``) move with it,
first. A failed write raises `StorageError` and leaves no partial file.

Example::

    >>> import tempfile
    >>> target = Path(tempfile.mkdtemp()) / "state.bin"
    >>> digest = atomic_write(target, lambda tmp: tmp.write_bytes(b"weights"))
    >>> verify_digest(target)
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ort_lightning.errors import CheckpointError
from ort_lightning.ort import runtime as _ort
from ort_lightning.storage.space import check_space, size_of, write_failure
from ort_lightning.storage.temps import COMPANION_SUFFIXES, TEMP_SUFFIX, temp_prefix

__all__ = [
    "DIGEST_SUFFIX",
    "atomic_write",
    "digest_path",
    "fsync",
    "remove_with_digest",
    "sha256_of",
    "verify_digest",
]

DIGEST_SUFFIX = ".sha256"
_CHUNK = 1 << 20


def digest_path(path: Path) -> Path:
    """The sidecar that holds the accepted sha256 digests of `path`."""
    return path.with_name(path.name + DIGEST_SUFFIX)


def sha256_of(path: Path) -> str:
    """Return the hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Put a file's data, or a folder's entries (a rename, a new file), on disk."""
    # NOTE: a file's data and a rename are durable only once they and the folder's entry are on disk.
    if os.name == "nt" and path.is_dir():  # pragma: no cover - folders cannot be opened on Windows
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _umask() -> int:
    """The process's umask, read without changing it where the OS allows (Linux)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it, briefly
    os.umask(mask)
    return mask


def _temp_path(path: Path) -> Path:
    fd, name = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=TEMP_SUFFIX, dir=path.parent)
    # NOTE: mkstemp creates the file 0600 and the rename keeps it; a serving process or a sync
    # job of another user must read the model it is handed, as it reads torch.save's files.
    os.chmod(name, 0o666 & ~_umask())
    os.close(fd)
    return Path(name)


@contextlib.contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; remove it if the block fails before renaming it."""
    temp = _temp_path(path)
    try:
        yield temp
    except BaseException:
        for leftover in (temp, *_companions(temp)):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
        raise


def _companions(temp: Path) -> list[Path]:
    """The companion files a writer left beside `temp` (``temp.data``)."""
    return [companion for suffix in COMPANION_SUFFIXES if (companion := temp.with_name(temp.name + suffix)).exists()]


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(temp)`, flush, rename over `path`, flush the folder."""
    with _staged(path) as temp:
        write(temp)
        fsync(temp)
        os.replace(temp, path)
    fsync(path.parent)


def _read_digests(sidecar: Path) -> list[str]:
    try:
        text = sidecar.read_text(encoding="ascii")
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def _write_digests(path: Path, digests: list[str]) -> None:
    text = "".join(f"{digest}  {path.name}\n" for digest in digests)
    _replace(digest_path(path), lambda temp: temp.write_text(text, encoding="ascii"))


def _current_digest(path: Path) -> str | None:
    """The digest of the file now at `path`, from its sidecar when that is unambiguous."""
    if not path.exists():
        return None
    recorded = _read_digests(digest_path(path))
    return recorded[0] if len(recorded) == 1 else sha256_of(path)


def _size_on_disk(temp: Path) -> int:
    return sum(size_of(file) or 0 for file in (temp, *_companions(temp)))


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[Path], object],
    *,
    digest: bool = True,
    expected_size: int | None = None,
) -> str:
    """Write `path` atomically through ``write(temp_path)``; return the new file's sha256.

    Args:
        path: the file to create or replace; its folder is created when missing.
        write: writes the complete file (and maybe ``<temp>.data``) at the temporary path it is given.
        digest: keep a ``.sha256`` sidecar that `verify_digest` checks.
        expected_size: bytes checked against the free space first; None: the replaced file's size.

    Raises:
        StorageError: when the disk has too little space or the write fails; the previous file is intact.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    needed = expected_size if expected_size is not None else size_of(target)
    check_space(target, needed=needed)
    with _staged(target) as temp:
        try:
            new, moves = _write_staged(target, temp, write, digest=digest)
        except _ort.WRITE_ERRORS as error:
            # NOTE: measured while the partial file still holds its space; _staged then removes it.
            raise write_failure(target, error, written=_size_on_disk(temp), needed=needed) from error
        for source, destination, _ in moves:
            os.replace(source, destination)
    fsync(target.parent)
    if digest:
        for _, destination, settled in moves:
            if settled is not None:
                _write_digests(destination, [settled])
    return new


def _write_staged(
    target: Path, temp: Path, write: Callable[[Path], object], *, digest: bool
) -> tuple[str, list[tuple[Path, Path, str | None]]]:
    """Write and flush `temp` and its companions; return the renames, companions first."""
    write(temp)
    files = [*_companions(temp), temp]
    moves: list[tuple[Path, Path, str | None]] = []
    new = ""
    for file in files:
        fsync(file)
        destination = target if file == temp else target.with_name(target.name + file.name[len(temp.name):])
        new = sha256_of(file)
        settled: str | None = None
        if digest:
            old = _current_digest(destination)
            # NOTE: both digests are accepted while the rename is in flight (see module docstring).
            _write_digests(destination, [new] if old in (None, new) else [new, old])
            settled = new if old not in (None, new) else None
        moves.append((file, destination, settled))
    return new, moves


def verify_digest(path: str | os.PathLike[str]) -> bool:
    """Check a file (and its companions) against its sidecar; False when there is no sidecar.

    Raises:
        CheckpointError: for a missing or empty file, or bytes that match no recorded digest.
    """
    target = Path(path)
    if not target.is_file():
        raise CheckpointError(
            f"Checkpoint {target} does not exist or is not a file; pass the path of a checkpoint file "
            "written by ORTCheckpoint or save_ort_checkpoint."
        )
    if target.stat().st_size == 0:
        raise CheckpointError(
            f"Checkpoint {target} is empty (0 bytes), so a write to it never finished; resume from another "
            "checkpoint (for instance the previous epoch's file)."
        )
    found = _matches_digest(target)
    for companion in _companions_of(target):
        _matches_digest(companion)
    return found


def _companions_of(path: Path) -> list[Path]:
    return [companion for suffix in COMPANION_SUFFIXES if (companion := path.with_name(path.name + suffix)).is_file()]


def _matches_digest(target: Path) -> bool:
    accepted = _read_digests(digest_path(target))
    if not accepted:
        return False
    actual = sha256_of(target)
    if actual not in accepted:
        raise CheckpointError(
            f"Checkpoint {target} is corrupted or truncated: its sha256 {actual[:16]}... matches none of "
            f"{[digest[:16] + '...' for digest in accepted]} recorded in {digest_path(target).name}; "
            "resume from another checkpoint, or delete the sidecar only if you trust the file."
        )
    return True


def remove_with_digest(path: Path) -> None:
    """Delete a file, its companions, then their sidecars (never leave a file without the digest that guards it)."""
    companions = _companions_of(path)
    for target in (path, *companions, digest_path(path), *map(digest_path, companions)):
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
