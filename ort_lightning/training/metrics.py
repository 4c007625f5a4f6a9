"""Per-stage torchmetrics fed from the model outputs of the ORT graphs.

Example::

    >>> from torchmetrics.classification import MulticlassAccuracy
    >>> list(stage_metrics(MulticlassAccuracy(num_classes=3))["val"].keys(keep_base=False))
    ['val_MulticlassAccuracy']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ort_lightning.errors import ConfigurationError

if TYPE_CHECKING:
    from ort_lightning.artifacts.manifest import Manifest

__all__ = ["STAGES", "stage_metrics", "stage_metrics_for"]

STAGES = ("train", "val", "test")


def stage_metrics(metrics: Any) -> dict[str, Any]:
    """Clone `metrics` (Metric, MetricCollection or dict) per stage, prefixed ``train_``, ``val_``, ``test_``.

    Raises:
        ConfigurationError: for anything torchmetrics cannot collect.
    """
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError as error:  # pragma: no cover - torchmetrics comes with the test extra
        raise ConfigurationError("`metrics=` needs torchmetrics; run `pip install torchmetrics`.") from error
    if not _is_metrics(metrics, Metric, MetricCollection):
        raise ConfigurationError(
            "Expected argument `metrics` to be a torchmetrics Metric, a MetricCollection or a dict name -> Metric, "
            f"but got {type(metrics).__name__}; e.g. metrics=MulticlassAccuracy(num_classes=10)."
        )
    collection = metrics if isinstance(metrics, MetricCollection) else MetricCollection(metrics)
    return {stage: collection.clone(prefix=f"{stage}_") for stage in STAGES}


def stage_metrics_for(metrics: Any, manifest: Manifest) -> dict[str, Any]:
    """`stage_metrics` for artifacts whose graphs have a model output and a label (`ConfigurationError` else)."""
    if not manifest.outputs or not manifest.labels:
        raise ConfigurationError(
            f"`metrics` need a model output and a label, but the artifacts have outputs {list(manifest.outputs)} "
            f"and labels {[s.name for s in manifest.labels]}; export with a loss that takes labels "
            "(e.g. loss='cross_entropy'), or drop `metrics`."
        )
    return stage_metrics(metrics)


def _is_metrics(metrics: Any, metric: type, collection: type) -> bool:
    if isinstance(metrics, (metric, collection)):
        return True
    return isinstance(metrics, Mapping) and bool(metrics) and all(isinstance(m, metric) for m in metrics.values())

