"""Pickling and re-attachment of `ORTLightningModule`'s ORT state.

ONNX Runtime's objects do not pickle, yet Lightning's spawn launcher and ``copy.deepcopy`` copy
a module by pickling it, and the spawn launcher on CPU also replaces every parameter's
``.data`` with a copy. `picklable` leaves the ORT objects out of the pickle (the module rebuilds
them from the artifacts with the pickled values, see `values_of` / `load_values`), and
`views_attached` tells when the torch tensors are no longer views of ORT's state, so that
``configure_model`` can attach them again.

Example::

    >>> import copy, tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp()))
    >>> twin = copy.deepcopy(module)
    >>> torch.equal(twin.weight, module.weight), twin.weight.data_ptr() != module.weight.data_ptr()
    (True, True)
"""

from __future__ import annotations

from typing import Any

import torch

from ort_lightning.bridge import parameter_views
from ort_lightning.ort import runtime as _ort

__all__ = ["DEVICE_KEY", "load_values", "picklable", "values_of", "views_attached"]

#: Attributes holding ORT objects or views of them, rebuilt after unpickling (spawn, deepcopy).
_UNPICKLED = ("_session", "_train_inputs", "_eval_inputs", "_placeholders", "_gradients", "_train_step", "_eval_step")
#: Where the pickle says which device the ORT objects ran on.
DEVICE_KEY = "_ort_device"


def picklable(state: dict[str, Any], session: _ort.TrainingSession) -> dict[str, Any]:
    """A module's ``__dict__`` without ORT's objects, with the device to rebuild them on."""
    state = dict(state)
    for key in _UNPICKLED:
        state.pop(key, None)
    state[DEVICE_KEY] = session.device
    state["_schedule"] = None  # it holds the optimizer, which holds ORT's objects
    return state


def values_of(module: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of every parameter and buffer, to load into rebuilt ORT objects."""
    return [t.detach().clone() for t in (*module.parameters(), *module.buffers())]


@torch.no_grad()
def load_values(module: torch.nn.Module, values: list[torch.Tensor]) -> None:
    """Copy what `values_of` returned into the module's (ORT-backed) parameters and buffers."""
    for tensor, value in zip((*module.parameters(), *module.buffers()), values, strict=True):
        tensor.copy_(value)


def views_attached(module: torch.nn.Module, session: _ort.TrainingSession) -> bool:
    """Tell whether every parameter and buffer of `module` still shares memory with `session`'s state."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return all(
        view.name not in tensors or tensors[view.name].data_ptr() == view.data.data_ptr()
        for view in parameter_views(session)
    )
