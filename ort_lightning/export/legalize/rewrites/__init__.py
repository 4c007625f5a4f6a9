"""The rewrites of `ort_lightning.export.legalize.engine.RULES`, one family per module."""
