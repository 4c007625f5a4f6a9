"""The eval graph's part of `ORTLightningModule`: `ModuleEvaluation` does the work, `EvaluationHooks` are the hooks.

The hooks (``forward``, ``validation_step``, ``test_step``, ``predict_step``, ``evaluate_batch``)
hand their batch to the one collaborator, which runs ORT's eval graph and updates the stage's metrics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ort_lightning.bridge import to_torch

if TYPE_CHECKING:
    from ort_lightning.bridge import LabelRange
    from ort_lightning.training.session.live import LiveSession

__all__ = ["EvaluationHooks", "ModuleEvaluation"]


class ModuleEvaluation:
    """Run a module's eval graph on its batches and update the stage's metrics.

    Args:
        live: the module's running ORT session.
        labels: the label range checked per batch, or None.
        metrics: stage -> metric collection, empty without metrics.
        label_index: where the first label sits in a batch (after the model inputs).
    """

    def __init__(
        self, live: LiveSession, *, labels: LabelRange | None, metrics: Mapping[str, Any], label_index: int
    ) -> None:
        self.live, self.labels, self.metrics, self.label_index = live, labels, metrics, label_index

    def forward(self, inputs: Sequence[torch.Tensor]) -> Any:
        """The model outputs for model inputs alone (placeholders fill the labels)."""
        return self.live.evaluator.predict(inputs, entry="forward()", labels_allowed=False)

    def predict(self, batch: Any) -> Any:
        """The model outputs for a batch of model inputs (labels, if present, are ignored)."""
        return self.live.evaluator.predict(batch, entry="predict_step()", labels_allowed=True)

    def evaluate(self, batch: Any) -> tuple[Sequence[torch.Tensor], Any, torch.Tensor]:
        """Run the eval graph on a labelled `batch`; return its tensors, the fetches and the loss."""
        return self.live.evaluator.evaluate(batch, self.labels)

    def outputs(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """``(loss, *model_outputs)`` of the eval graph on one labelled `batch`."""
        _, fetches, loss = self.evaluate(batch)
        return (loss, *(to_torch(fetches[i]) for i in range(1, len(fetches))))

    def update_metrics(self, stage: str, fetches: Any, tensors: Sequence[torch.Tensor]) -> Any | None:
        """Update `stage`'s metrics with the logits and the first label; return them to log (None: no metrics)."""
        if not self.metrics:
            return None
        collection = self.metrics[stage]
        collection.update(to_torch(fetches[1]), tensors[self.label_index])
        return collection


class EvaluationHooks(pl.LightningModule):
    """The eval graph's hooks of an `ORTLightningModule`: each hands its batch to `evaluation` and logs."""

    evaluation: ModuleEvaluation

    @override
    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the eval graph on model inputs (placeholders fill the labels); return the model outputs."""
        return self.evaluation.forward(inputs)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Run the eval graph and log ``val_loss`` (and the ``val_`` metrics)."""
        return self._evaluate("val", batch)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Run the eval graph and log ``test_loss`` (and the ``test_`` metrics)."""
        return self._evaluate("test", batch)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Return the model outputs for a batch of model inputs (labels, if present, are ignored)."""
        return self.evaluation.predict(batch)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """Run the eval graph on one labelled batch, outside any Trainer; return ``(loss, *model_outputs)``.

        Example::

            >>> import tempfile, torch
            >>> from ort_lightning import ORTLightningModule, export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
            >>> loss, logits = ORTLightningModule(artifacts).evaluate_batch((torch.zeros(2, 4), torch.tensor([0, 2])))
            >>> tuple(loss.shape), tuple(logits.shape)
            ((), (2, 3))
        """
        return self.evaluation.outputs(batch)

    def _evaluate(self, stage: str, batch: Any) -> torch.Tensor:
        tensors, fetches, loss = self.evaluation.evaluate(batch)
        size = tensors[0].shape[0]
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=size, sync_dist=self.trainer.world_size > 1)
        self._log_metrics(stage, fetches, tensors)
        return loss

    def _log_metrics(self, stage: str, fetches: Any, tensors: Sequence[torch.Tensor]) -> None:
        collection = self.evaluation.update_metrics(stage, fetches, tensors)
        if collection is not None:
            self.log_dict(collection, on_step=False, on_epoch=True, batch_size=tensors[0].shape[0])
