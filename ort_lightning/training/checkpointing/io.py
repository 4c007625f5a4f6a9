"""Lightning ``.ckpt`` files written atomically: a kill or a full disk never leaves a truncated one.

Lightning's ``TorchCheckpointIO`` commits through a temporary file in the system's temp folder:
across file systems that is a copy, neither atomic nor flushed. `AtomicCheckpointIO` writes beside
the file, fsyncs and renames; `ORTLightningModule.setup` installs it unless the user chose a plugin.
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
        """Write `checkpoint` to `path` atomically (`StorageError` leaves the previous file intact)."""
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
