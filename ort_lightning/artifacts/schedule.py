"""The learning-rate schedule an optimizer graph computes itself, as the manifest records it.

onnxruntime-web cannot set ``learning_rate``; a ``prepare_for_web`` folder computes it from the
``step`` input instead (`GraphSchedule`); a plain folder's rate is fed by the runtime (`RUNTIME_FED`).
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

    Example::

        >>> schedule = GraphSchedule("linear", 1.0, warmup_steps=2, total_steps=4)
        >>> [schedule.factor(s) for s in range(5)], schedule.arguments()
        ([0.0, 0.5, 1.0, 0.5, 0.0], "lr=1.0, lr_scheduler='linear', warmup_steps=2, total_steps=4")
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
        """The ``ORTLightningModule`` arguments that train at this schedule's rate."""
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
        """Read the schedule an optimizer graph's metadata records (`METADATA_KEY`), None when it records none."""
        text = metadata.get(METADATA_KEY)
        return None if text is None else cls.from_dict(json.loads(text))


def graph_schedule(path: Path) -> GraphSchedule | None:
    """The schedule an optimizer graph computes itself, as its metadata says; None if none."""
    if path.suffix == ".ort":
        return GraphSchedule.from_metadata(_ort.ort_metadata(path))
    proto = onnx.load(path, load_external_data=False)
    return GraphSchedule.from_metadata({entry.key: entry.value for entry in proto.metadata_props})
