"""Atomic, verified file writes: a crash at any instant leaves the previous file intact.

A file is written under a temporary name in its own folder, flushed to disk, then renamed
over the target (a rename within one folder is atomic on POSIX and Windows). A sidecar
``<name>.sha256`` holds the digests the file may have: while a replacement is in flight it
lists both the old and the new digest, so that whichever of the two files a crash leaves
behind still verifies, and a corrupted or truncated file verifies as neither.

Example::

    >>> import tempfile
    >>> from pathlib import Path
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

__all__ = [
    "DIGEST_SUFFIX",
    "TEMP_SUFFIX",
    "atomic_write",
    "check_writable",
    "digest_path",
    "remove_stale_temps",
    "remove_with_digest",
    "sha256_of",
    "verify_digest",
]

DIGEST_SUFFIX = ".sha256"
TEMP_SUFFIX = ".tmp"
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


def _fsync_file(path: Path) -> None:
    with path.open("rb+") as stream:
        os.fsync(stream.fileno())


def _fsync_dir(folder: Path) -> None:
    # NOTE: the rename itself is only durable once the folder's entry is on disk.
    if os.name == "nt":  # pragma: no cover - folders cannot be opened on Windows
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
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
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """Write through `write(temp)`, flush, rename over `path`, flush the folder."""
    with _staged(path) as temp:
        write(temp)
        _fsync_file(temp)
        os.replace(temp, path)
    _fsync_dir(path.parent)


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


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object], *, digest: bool = True) -> str:
    """Write `path` atomically through ``write(temp_path)``; return the new file's sha256.

    Args:
        path: the file to create or replace; its folder is created when missing.
        write: writes the complete file at the temporary path it is given.
        digest: keep a ``.sha256`` sidecar that `verify_digest` checks.

    Returns:
        The hex sha256 of the file written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    old: str | None = None
    with _staged(target) as temp:
        write(temp)
        _fsync_file(temp)
        new = sha256_of(temp)
        if digest:
            old = _current_digest(target)
            # NOTE: both digests are accepted while the rename is in flight (see module docstring).
            _write_digests(target, [new] if old in (None, new) else [new, old])
        os.replace(temp, target)
    _fsync_dir(target.parent)
    if digest and old not in (None, new):
        _write_digests(target, [new])
    return new


def verify_digest(path: str | os.PathLike[str]) -> bool:
    """Check a file against its sidecar digest.

    Returns:
        True when the sidecar exists and the file matches it; False when there is no sidecar.

    Raises:
        CheckpointError: for a missing or empty file, or one whose bytes match no recorded digest.
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
    """Delete a file and then its sidecar (never leave a file without the digest that guards it)."""
    for target in (path, digest_path(path)):
        with contextlib.suppress(FileNotFoundError):
            target.unlink()


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete the temporary files that an interrupted `atomic_write` left in `folder`."""
    stale = [p for p in folder.glob(f".*{TEMP_SUFFIX}") if p.is_file()] if folder.is_dir() else []
    for temp in stale:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
    return stale


def check_writable(folder: Path) -> None:
    """Create `folder` if needed and prove that a file can be written there, before any training step.

    Raises:
        CheckpointError: naming the folder, why it cannot be written, and what to do.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-", suffix=TEMP_SUFFIX):
            pass
    except OSError as error:
        raise CheckpointError(
            f"Cannot write checkpoints to {folder} ({error.strerror or error}); it must be a folder you can write "
            "to: pass another `dirpath`, or fix that path's permissions, before training starts."
        ) from error
