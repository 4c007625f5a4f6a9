"""The folder contract: `TrainingArtifacts` and the manifest ``ort_lightning.json``.

Example::

    >>> from ort_lightning.artifacts import MANIFEST_NAME
    >>> MANIFEST_NAME
    'ort_lightning.json'
"""

from ort_lightning.artifacts.folder import FILES, TrainingArtifacts
from ort_lightning.artifacts.manifest import MANIFEST_NAME, UNVERIFIED_NAME, Manifest, TensorSpec

__all__ = ["FILES", "MANIFEST_NAME", "UNVERIFIED_NAME", "Manifest", "TensorSpec", "TrainingArtifacts"]
