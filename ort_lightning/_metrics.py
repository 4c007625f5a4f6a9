"""Per-stage torchmetrics fed from the model outputs of the ORT graphs.

`stage_metrics` clones the user's metrics once per stage, with the stage as prefix
(``train_``, ``val_``, ``test_``), so that each stage accumulates its own state and logs under
its own names: a single ``MulticlassAccuracy`` becomes ``val_MulticlassAccuracy``, a dict
``{"acc": ...}`` becomes ``val_acc``.

Example::

    >>> from torchmetrics.classification import MulticlassAccuracy
    >>> metrics = stage_metrics(MulticlassAccuracy(num_classes=3))
    >>> list(metrics["val"].keys(keep_base=False))
    ['val_MulticlassAccuracy']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ort_lightning.errors import ConfigurationError

__all__ = ["STAGES", "stage_metrics"]

STAGES = ("train", "val", "test")


def stage_metrics(metrics: Any) -> dict[str, Any]:
    """Clone `metrics` (a torchmetrics Metric, MetricCollection or dict name -> Metric) per stage.

    Returns:
        ``{"train": MetricCollection, "val": ..., "test": ...}`` with prefixes ``train_`` etc.

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


def _is_metrics(metrics: Any, metric: type, collection: type) -> bool:
    if isinstance(metrics, (metric, collection)):
        return True
    return isinstance(metrics, Mapping) and bool(metrics) and all(isinstance(m, metric) for m in metrics.values())

