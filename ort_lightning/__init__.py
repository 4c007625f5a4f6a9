"""ort-lightning: train ONNX Runtime training artifacts with an ordinary ``lightning.Trainer``.

Example::

    >>> import ort_lightning
    >>> sorted(ort_lightning.__all__)[:3]
    ['ORTCheckpoint', 'ORTDDPStrategy', 'ORTLightningModule']
"""

from __future__ import annotations

from ort_lightning._version import __version__
from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.callbacks import ORTCheckpoint
from ort_lightning.export import export_artifacts
from ort_lightning.strategies import ORTDDPStrategy
from ort_lightning.training import ORTLightningModule, ORTOptimizer

__all__ = [
    "ORTCheckpoint",
    "ORTDDPStrategy",
    "ORTLightningModule",
    "ORTOptimizer",
    "TrainingArtifacts",
    "__version__",
    "export_artifacts",
]
