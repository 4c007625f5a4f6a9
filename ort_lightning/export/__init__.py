"""Export: a torch module or an ONNX model becomes training artifacts, stage by stage.

``source`` -> ``before_generation`` (``legalize/``) -> generation (``ort_lightning.ort``, with
``losses/``) -> ``after_generation`` -> ``verify/``; `export_artifacts` in ``pipeline`` runs them
in that order. `prepare_for_web` (``web``, with ``lr_graph``) derives a device folder whose optimizer
graph computes its own learning rate.
"""

from ort_lightning.export.pipeline import export_artifacts
from ort_lightning.export.web import prepare_for_web

__all__ = ["export_artifacts", "prepare_for_web"]
