"""Losses as torch users write them (``spec``), built as ONNX subgraphs ORT can differentiate (``graphs``)."""

from ort_lightning.export.losses.spec import LossSpec, resolve_loss

__all__ = ["LossSpec", "resolve_loss"]
