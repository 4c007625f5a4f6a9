"""Pickling and re-attachment of `ORTLightningModule`'s ORT state.

ONNX Runtime's objects do not pickle, yet Lightning's spawn launcher and ``copy.deepcopy`` copy
a module by pickling it, and the spawn launcher on CPU also replaces every parameter's
``.data`` with a copy. `PortableMixin` leaves the ORT objects out of the pickle and rebuilds
them from the artifacts with the pickled values, and tells when the torch tensors are no longer
views of ORT's state so that ``configure_model`` can attach them again.

Example::

    >>> import copy, tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp()))
    >>> twin = copy.deepcopy(module)
    >>> torch.equal(twin.weight, module.weight), twin.weight.data_ptr() != module.weight.data_ptr()
    (True, True)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ort_lightning import _ort
from ort_lightning.bridge import parameter_views

__all__ = ["PortableMixin"]

#: Attributes holding ORT objects or views of them, rebuilt after unpickling (spawn, deepcopy).
_UNPICKLED = ("_session", "_train_inputs", "_eval_inputs", "_placeholders", "_gradients", "_train_step", "_eval_step")


class PortableMixin(torch.nn.Module):
    """Pickling support mixed into `ORTLightningModule` (ahead of ``LightningModule``)."""

    _session: _ort.TrainingSession

    if TYPE_CHECKING:

        def _assemble(
            self, device: str, checkpoint: str | os.PathLike[str] | None = None, *, spinning: bool = True
        ) -> _ort.TrainingSession: ...

    def __getstate__(self) -> dict[str, Any]:
        """Leave the ORT objects out (they do not pickle); `__setstate__` rebuilds them."""
        state: dict[str, Any] = dict(super().__getstate__())
        for key in _UNPICKLED:
            state.pop(key, None)
        state["_ort_device"] = self._session.device
        state["_schedule"] = None  # it holds the optimizer, which holds ORT's objects
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the ORT objects from the artifacts, then restore the pickled parameter values."""
        device = state.pop("_ort_device")
        super().__setstate__(state)
        values = self._values()
        self._session = self._assemble(device)
        self._load_values(values)

    def _values(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in (*self.parameters(), *self.buffers())]

    @torch.no_grad()
    def _load_values(self, values: list[torch.Tensor]) -> None:
        for tensor, value in zip((*self.parameters(), *self.buffers()), values, strict=True):
            tensor.copy_(value)

    def _views_attached(self) -> bool:
        """Tell whether every parameter and buffer still shares memory with ORT's state."""
        tensors = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        return all(
            view.name not in tensors or tensors[view.name].data_ptr() == view.data.data_ptr()
            for view in parameter_views(self._session)
        )
