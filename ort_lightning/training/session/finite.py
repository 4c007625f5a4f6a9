"""After each optimizer update: are the trained parameters still finite?

A finite loss does not prove a finite update (inputs near 1e38 overflow the moments). The step
path checks the parameters where a NaN/inf loss shows up, at each epoch's end and before a save,
and stops the fit: the update has already run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ort_lightning.errors import NonFiniteLossError

__all__ = ["FiniteCheck", "nonfinite_parameters"]


class FiniteCheck:
    """Whether every value of some tensors is finite: one ``aminmax`` per tensor into a buffer made once.

    Example::

        >>> weights = [torch.ones(3), torch.zeros(2, 2)]
        >>> check = FiniteCheck(weights)
        >>> weights[1][0, 1] = float("nan")
        >>> check.holds()
        False
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        # NOTE: detached once: views of the same memory, which ORT's updates write in place.
        self.tensors = [tensor.detach() for tensor in tensors if tensor.numel()]
        if not self.tensors:
            # NOTE: no buffers at all: an empty storage cannot be shared with a spawned process (its fd is
            # invalid), and a module pickled for ``ort_ddp_spawn`` carries an unattached check.
            return
        device = self.tensors[0].device
        extremes = torch.empty(2 * len(self.tensors), device=device)
        self._slots = [(extremes[2 * i], extremes[2 * i + 1]) for i in range(len(self.tensors))]
        self._extremes = extremes
        self._total = (torch.empty((), device=device), torch.empty((), device=device))

    def holds(self) -> bool:
        """Whether every value of the tensors is finite."""
        if not self.tensors:
            return True
        for tensor, slot in zip(self.tensors, self._slots, strict=True):
            torch.aminmax(tensor, out=slot)
        low, high = self._total
        torch.aminmax(self._extremes, out=(low, high))
        return math.isfinite(low.item()) and math.isfinite(high.item())


def nonfinite_parameters(trainer: Any, *, update: int) -> NonFiniteLossError:
    """The error for the `update` (a global step) that left NaN/inf in the parameters."""
    module = trainer.lightning_module
    names = [name for name, parameter in module.named_parameters()
             if parameter.requires_grad and not bool(torch.isfinite(parameter).all())]
    return NonFiniteLossError(
        f"ORT's optimizer update at global_step={max(update, 0)} (epoch {trainer.current_epoch}) left NaN/inf "
        f"values in the parameters {names} although the loss was finite: the gradients or the update overflowed "
        "float32 (inputs or targets near 1e38, or an lr far too large). The update has run, so 'skip' cannot undo it "
        "and training cannot go on from these parameters; scale the data, lower the lr or clip the gradients "
        "(Trainer(gradient_clip_val=...)), and resume from the last checkpoint."
    )
