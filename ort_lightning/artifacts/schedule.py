"""The learning-rate schedule an optimizer graph computes itself, as the manifest records it.

ONNX Runtime feeds every optimizer graph a ``learning_rate`` input, which its Python and C++
builds set (``Optimizer.set_learning_rate``) and onnxruntime-web cannot (it always feeds ORT's
default 1e-3). A folder from ``ort_lightning.export.prepare_for_web`` computes its rate inside the
optimizer graph from the ``step`` input instead, and its manifest says which (`GraphSchedule`);
a plain folder's rate is fed by the runtime (`RUNTIME_FED`).

Example::

    >>> GraphSchedule("linear", 0.01, warmup_steps=10, total_steps=100).describe()
    'linear warmup 10 steps to 0.01, decay to 0 at step 100, computed in the optimizer graph'
    >>> [GraphSchedule("linear", 1.0, warmup_steps=2, total_steps=4).factor(s) for s in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ort_lightning.ort import runtime as _ort

__all__ = ["KINDS", "METADATA_KEY", "RUNTIME_FED", "GraphSchedule", "graph_schedule"]

#: The schedules an optimizer graph can carry.
KINDS = ("constant", "linear")
#: The optimizer graph's metadata entry that records its schedule (JSON), so that a folder without manifest tells it.
METADATA_KEY = "ort_lightning.lr_schedule"
#: What ``inspect`` says of a folder whose optimizer graph takes its rate from the runtime.
RUNTIME_FED = "fed by the runtime (onnxruntime-web trains such a folder at ORT's default 1e-3)"


@dataclass(frozen=True)
class GraphSchedule:
    """A learning rate computed in the optimizer graph: ``lr(s) = lr * factor(s)``, `s` completed optimizer steps.

    ``"constant"``: factor 1. ``"linear"``: the linear warmup and decay of
    ``ORTLightningModule(lr_scheduler="linear")``, ``s / max(1, W)`` for ``s < W``, else
    ``max(0, (T - s) / max(1, T - W))``.

    Example::

        >>> GraphSchedule("constant", 0.01).describe()
        'constant 0.01, computed in the optimizer graph'
    """

    kind: str
    lr: float
    warmup_steps: int = 0
    total_steps: int | None = None

    def factor(self, step: int) -> float:
        """The multiplier of `lr` after `step` completed optimizer steps (the graph computes it in float64)."""
        if self.kind == "constant" or self.total_steps is None:
            return 1.0
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        return max(0.0, (self.total_steps - step) / max(1, self.total_steps - self.warmup_steps))

    def describe(self) -> str:
        """One line for ``ort-lightning inspect``."""
        if self.kind == "constant":
            return f"constant {self.lr:g}, computed in the optimizer graph"
        return (
            f"linear warmup {self.warmup_steps} steps to {self.lr:g}, decay to 0 at step {self.total_steps}, "
            "computed in the optimizer graph"
        )

    def arguments(self) -> str:
        """The ``ORTLightningModule`` arguments that train at this schedule's rate.

        Example::

            >>> GraphSchedule("linear", 0.05, warmup_steps=3, total_steps=8).arguments()
            "lr=0.05, lr_scheduler='linear', warmup_steps=3, total_steps=8"
        """
        if self.kind == "constant":
            return f"lr={self.lr!r}, lr_scheduler='constant'"
        return (f"lr={self.lr!r}, lr_scheduler='linear', warmup_steps={self.warmup_steps}, "
                f"total_steps={self.total_steps}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphSchedule:
        """Read the manifest's ``lr_schedule`` entry (`dataclasses.asdict` of one)."""
        total = data.get("total_steps")
        return cls(str(data["kind"]), float(data["lr"]), int(data.get("warmup_steps", 0)),
                   None if total is None else int(total))

    @classmethod
    def from_metadata(cls, metadata: dict[str, str]) -> GraphSchedule | None:
        """Read the schedule an optimizer graph's metadata records (`METADATA_KEY`), None when it records none.

        Example::

            >>> GraphSchedule.from_metadata({METADATA_KEY: '{"kind": "constant", "lr": 0.01}'})
            GraphSchedule(kind='constant', lr=0.01, warmup_steps=0, total_steps=None)
        """
        text = metadata.get(METADATA_KEY)
        return None if text is None else cls.from_dict(json.loads(text))


def graph_schedule(path: Path) -> GraphSchedule | None:
    """The schedule an optimizer graph (``.onnx`` or ``.ort``) computes itself, as its metadata says; None if none.

    What a folder without manifest (a device's copy of the graphs) tells of its rate.
    """
    if path.suffix == ".ort":
        return GraphSchedule.from_metadata(_ort.ort_metadata(path))
    proto = onnx.load(path, load_external_data=False)
    return GraphSchedule.from_metadata({entry.key: entry.value for entry in proto.metadata_props})
