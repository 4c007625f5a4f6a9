"""Lightning ``.ckpt`` files written atomically: a kill or a full disk never leaves a truncated one.

Lightning's ``TorchCheckpointIO`` writes a local ``.ckpt`` through an fsspec transaction whose
temporary file lies in the system's temp folder: its commit is a copy into place when that is
another file system, neither atomic nor flushed, so a kill or a full disk during it leaves
``last.ckpt`` truncated, and a resume from it fails. `AtomicCheckpointIO` serializes the
checkpoint in memory, checks the free space against its size, and writes it with
`ort_lightning.storage.atomic.atomic_write` (a temporary file beside it, fsync, rename); a
failure raises `StorageError` naming the path, with the previous file intact.

`ORTLightningModule.setup` installs it (`install_atomic_io`) when the strategy uses Lightning's
plain ``TorchCheckpointIO``; a checkpoint IO plugin the user chose is left alone.

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp()) / "last.ckpt"
    >>> AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(3)}, path)
    >>> int(torch.load(path, weights_only=True)["step"])
    3
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from ort_lightning.storage.atomic import atomic_write

__all__ = ["AtomicCheckpointIO", "install_atomic_io"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic, fsynced and checked for free space first."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write `checkpoint` to `path` atomically (remote URLs go through Lightning's own writer).

        Raises:
            StorageError: for too little free space or a failed write; the previous file is intact.
        """
        if storage_options is not None or "://" in os.fspath(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getbuffer()
        # NOTE: no digest sidecar: a .ckpt is read by torch.load and Lightning, which would not check it.
        atomic_write(Path(path), lambda temp: temp.write_bytes(data), digest=False, expected_size=len(data))


def install_atomic_io(strategy: Any) -> None:
    """Give `strategy` an `AtomicCheckpointIO` when it uses Lightning's plain ``TorchCheckpointIO``."""
    # NOTE: exactly that class: a subclass or a wrapper (AsyncCheckpointIO) is the user's choice.
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
