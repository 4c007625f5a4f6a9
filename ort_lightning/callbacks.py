"""Lightning callbacks of the package: `ORTCheckpoint`.

Its code lives with the rest of the checkpoint files, in
`ort_lightning.training.checkpointing.callback`; this is its public import path.
"""

from ort_lightning.training.checkpointing.callback import ORTCheckpoint

__all__ = ["ORTCheckpoint"]
