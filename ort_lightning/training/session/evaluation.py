"""`EvaluationMethods`: the eval graph's part of `ORTLightningModule`: forward, validate, test, predict.

`ORTLightningModule` derives from it. Each method runs ORT's eval graph through the module's
running session (`ort_lightning.training.session.live.LiveSession.evaluator`: a session built for
training alone is rebuilt with the eval graph once): ``forward`` and
``predict_step`` on model inputs (placeholders fill the labels), ``validation_step``,
``test_step`` and `evaluate_batch` on labelled batches, logging the loss and the stage's metrics.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> isinstance(module, EvaluationMethods), module(torch.zeros(5, 4)).shape
    (True, torch.Size([5, 3]))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from ort_lightning.bridge import to_torch

if TYPE_CHECKING:
    from ort_lightning.bridge import LabelRange
    from ort_lightning.training.session.live import LiveSession

__all__ = ["EvaluationMethods"]


class EvaluationMethods(pl.LightningModule):
    """The eval graph's hooks of an `ORTLightningModule`; the module sets the attributes below.

    Attributes:
        _live: the running ORT session.
        _labels: the label range checked per batch, or None.
        _metrics: stage -> metric collection (``train``, ``val``, ``test``), empty without metrics.
        _label_index: where the first label sits in a batch (after the model inputs).
    """

    _live: LiveSession
    _labels: LabelRange | None
    _metrics: dict[str, Any]
    _label_index: int

    @override
    def forward(self, *inputs: torch.Tensor) -> Any:
        """Run the eval graph on model inputs; return its model outputs as torch tensors.

        Labels are not needed: placeholders fill the label inputs (the loss is discarded).
        """
        return self._live.evaluator.predict(inputs, entry="forward()", labels_allowed=False)

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
        return self._live.evaluator.predict(batch, entry="predict_step()", labels_allowed=True)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any) -> tuple[torch.Tensor, ...]:
        """Run the eval graph on one labelled batch, outside any Trainer; return ``(loss, *model_outputs)``.

        Args:
            batch: a tuple/list in the order of the graph's inputs (model inputs, then labels), or a
                dict keyed by input name, as for ``validation_step``.

        Example::

            >>> import tempfile, torch
            >>> from ort_lightning import ORTLightningModule, export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
            >>> module = ORTLightningModule(artifacts)
            >>> loss, logits = module.evaluate_batch((torch.zeros(2, 4), torch.tensor([0, 2])))
            >>> tuple(loss.shape), tuple(logits.shape)
            ((), (2, 3))
        """
        _, fetches, loss = self._live.evaluator.evaluate(batch, self._labels)
        return (loss, *(to_torch(fetches[i]) for i in range(1, len(fetches))))

    def _evaluate(self, stage: str, batch: Any) -> torch.Tensor:
        tensors, fetches, loss = self._live.evaluator.evaluate(batch, self._labels)
        size = tensors[0].shape[0]
        self.log(f"{stage}_loss", loss, prog_bar=True, batch_size=size, sync_dist=self.trainer.world_size > 1)
        if self._metrics:
            self._update_metrics(stage, fetches, tensors)
        return loss

    def _update_metrics(self, stage: str, fetches: Any, tensors: Any) -> None:
        collection = self._metrics[stage]
        collection.update(to_torch(fetches[1]), tensors[self._label_index])
        self.log_dict(collection, on_step=False, on_epoch=True, batch_size=tensors[0].shape[0])
