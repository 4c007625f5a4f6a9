"""ort-lightning: train ONNX Runtime training artifacts with an ordinary ``lightning.Trainer``.

The public names are imported on first use, so that a process that needs no Lightning (``ort-lightning
inspect``, ``ort-lightning export``) does not import it: Lightning's import alone costs seconds. ONNX
Runtime is imported at once: a missing or wrong build fails here, with the install command.

Example::

    >>> import ort_lightning
    >>> sorted(ort_lightning.__all__)[:3]
    ['ORTCheckpoint', 'ORTDDPStrategy', 'ORTLightningModule']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ort_lightning.ort._api  # noqa: F401 - ONNX Runtime's build checked, its logging quieted
from ort_lightning._lazy import lazy_names
from ort_lightning._version import __version__

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts
    from ort_lightning.callbacks import ORTCheckpoint
    from ort_lightning.export import export_artifacts
    from ort_lightning.strategies import ORTDDPStrategy
    from ort_lightning.training import ORTLightningModule, ORTOptimizer, save_pretrained

#: Each public name and the module it comes from.
_HOMES = {
    "ORTCheckpoint": "ort_lightning.callbacks",
    "ORTDDPStrategy": "ort_lightning.strategies",
    "ORTLightningModule": "ort_lightning.training",
    "ORTOptimizer": "ort_lightning.training",
    "TrainingArtifacts": "ort_lightning.artifacts",
    "export_artifacts": "ort_lightning.export",
    "save_pretrained": "ort_lightning.training",
}

__all__ = [
    "ORTCheckpoint",
    "ORTDDPStrategy",
    "ORTLightningModule",
    "ORTOptimizer",
    "TrainingArtifacts",
    "__version__",
    "export_artifacts",
    "save_pretrained",
]


__getattr__, __dir__ = lazy_names(globals(), _HOMES)
