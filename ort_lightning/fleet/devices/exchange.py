"""`Exchange`: which state tensors cross the wire each round, and where they lie in ONNX Runtime's buffer.

A fleet sends what training changes: the trainable parameters and the buffers (BatchNorm's
statistics). The frozen ones (a LoRA model's base) reach a device once, in its folder's complete
checkpoint, and never travel per round. Each runtime moves the sent tensors as cheaply as ORT lets it:

- ``all``: nothing is frozen; the whole buffer travels (``get_contiguous_parameters(False)``);
- ``trainable``: frozen parameters and no buffers; ORT's trainable-only buffer is exactly what travels
  (``get_contiguous_parameters(True)``, ``loadParametersBuffer(buffer, true)``);
- ``spans``: frozen parameters and buffers; the device gathers the sent spans from the whole buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.fleet.devices.weight_order import WeightOrder

__all__ = ["MODES", "Exchange"]

MODES = ("all", "trainable", "spans")


@dataclass(frozen=True)
class Exchange:
    """The sent tensors (`sent`) of the whole state (`full`), and how a device reads and writes them (`mode`)."""

    full: WeightOrder
    sent: WeightOrder
    mode: str
    #: ``(start, end)`` of each run of sent values in the whole buffer, adjacent tensors merged.
    spans: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, artifacts: TrainingArtifacts, full: WeightOrder | None = None) -> Exchange:
        """The exchange of `artifacts`: every state tensor but the frozen parameters, in the buffer's order."""
        full = full or WeightOrder.of(artifacts)
        frozen = set(artifacts.manifest.frozen)
        sent = WeightOrder([(name, shape) for name, shape in full.tensors if name not in frozen])
        mode = "all" if not frozen else ("spans" if artifacts.manifest.buffers else "trainable")
        return cls(full, sent, mode, _runs(full, frozen))

    @property
    def frozen(self) -> list[str]:
        """The tensors that never travel."""
        sent = set(self.sent.names)
        return [name for name in self.full.names if name not in sent]

    def gather(self, whole: np.ndarray) -> np.ndarray:
        """The sent values out of the whole buffer (a new buffer)."""
        return np.concatenate([whole[start:end] for start, end in self.spans]) if self.spans else whole[:0].copy()

    def scatter(self, whole: np.ndarray, sent: np.ndarray) -> None:
        """Write the sent values into the whole buffer, in place."""
        at = 0
        for start, end in self.spans:
            whole[start:end] = sent[at : at + end - start]
            at += end - start

    def describe(self) -> dict[str, object]:
        """What a web device needs to read and write the sent values (the welcome's ``exchange``)."""
        return {"mode": self.mode, "size": self.sent.size, "spans": [list(span) for span in self.spans]}


def _runs(full: WeightOrder, frozen: set[str]) -> tuple[tuple[int, int], ...]:
    runs: list[list[int]] = []
    at = 0
    for name, shape in full.tensors:
        size = int(np.prod(shape, dtype=np.int64))
        if name not in frozen and size:
            if runs and runs[-1][1] == at:
                runs[-1][1] = at + size
            else:
                runs.append([at, at + size])
        at += size
    return tuple((start, end) for start, end in runs)
