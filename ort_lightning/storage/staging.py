"""A folder of files written as a whole: staged inside the destination, then moved into place.

The export's writers (some of them ONNX Runtime's) cannot write atomically; they write into a
hidden staging folder on the same file system, and only when every stage has passed are the files
fsynced and renamed over the destination's (`last` ones last). A failure leaves the destination as
it was, and a full disk becomes one `StorageError`, however a writer said it.

Example::

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp()) / "out"
    >>> with staged_folder(out, needed=10) as stage:
    ...     _ = (stage / "a.bin").write_bytes(b"new")
    >>> try:
    ...     with staged_folder(out, needed=10) as stage:
    ...         _ = (stage / "a.bin").write_bytes(b"newer")
    ...         raise ValueError("a stage failed")
    ... except ValueError:
    ...     pass
    >>> (out / "a.bin").read_bytes(), sorted(path.name for path in out.iterdir())
    (b'new', ['a.bin'])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path

from ort_lightning.ort import runtime as _ort
from ort_lightning.storage.atomic import fsync
from ort_lightning.storage.space import check_space, folder_space_failure
from ort_lightning.storage.temps import TEMP_SUFFIX, temp_prefix

__all__ = ["staged_folder"]


@contextlib.contextmanager
def staged_folder(
    destination: str | os.PathLike[str],
    *,
    needed: int | None,
    last: Collection[str] = (),
    obsolete: Collection[str] = (),
) -> Iterator[Path]:
    """Yield an empty staging folder; on success move its files into `destination`.

    Args:
        destination: the folder the files belong in; created when missing.
        needed: bytes the files will about take, checked against the free space first; None checks nothing.
        last: names moved after all others (a manifest that describes the rest).
        obsolete: names removed from `destination` when the new set does not hold them.

    Raises:
        StorageError: when the file system has too little space; the destination is as it was.
    """
    folder = Path(destination)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        check_space(folder, needed=needed, folder=True)
        stage = Path(tempfile.mkdtemp(prefix=temp_prefix("export"), suffix=TEMP_SUFFIX, dir=folder))
    except BaseException:
        _remove_if_created(folder, created)
        raise
    try:
        yield stage
        _publish(stage, folder, last=last, obsolete=obsolete)
    except BaseException as error:
        failure = folder_space_failure(
            folder, error, written=_tree_bytes(stage), needed=needed, writes=_ort.WRITE_ERRORS
        )
        shutil.rmtree(stage, ignore_errors=True)
        _remove_if_created(folder, created)
        if failure is not None:
            raise failure from error
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, folder: Path, *, last: Collection[str], obsolete: Collection[str]) -> None:
    """Flush the staged files, then rename each over the destination's; a staged subfolder replaces its whole."""
    entries = sorted(stage.iterdir(), key=lambda path: path.name in last)
    for path in entries:
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            fsync(file)
    # NOTE: every byte is on disk before the first rename: a rename cannot run out of space, so from
    # here on the export cannot fail half-way for want of room.
    for path in entries:
        target = folder / path.name
        if target.is_dir():
            os.replace(target, stage / f".replaced-{path.name}")
        os.replace(path, target)
    published = {path.name for path in entries}
    for name in obsolete:
        target = folder / name
        if name in published or not target.exists():
            continue
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    fsync(folder)


def _tree_bytes(folder: Path) -> int:
    if not folder.is_dir():
        return 0
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _remove_if_created(folder: Path, created: bool) -> None:
    if created:
        with contextlib.suppress(OSError):  # NOTE: not empty means someone else wrote there meanwhile: keep it
            folder.rmdir()
