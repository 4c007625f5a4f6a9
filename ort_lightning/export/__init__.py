"""Export: a torch module or an ONNX model becomes training artifacts, stage by stage.

``source`` -> ``before_generation`` (``legalize/``) -> generation (``ort_lightning.ort``, with
``losses/``) -> ``after_generation`` -> ``verify/``; `export_artifacts` in ``pipeline`` runs them
in that order.
"""

from ort_lightning.export.pipeline import export_artifacts

__all__ = ["export_artifacts"]
