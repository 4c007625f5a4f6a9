"""ORT's CheckpointState in memory: read once (`read_state`), handed over (`HeldState`), filled, outlived.

A state read from a file starts one build (`ort_lightning.ort.session.assemble`) and answers its
own summary from the same read; a running session hands its state to the next build on the same
device. `copy_parameters` fills a state (a nominal one too) from one buffer, `buffer_order` measures
that buffer's layout, and `state_outlives` keeps a state alive as long as ORT's C++ Module needs it.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ort_lightning.errors import ConfigurationError
from ort_lightning.ort._api import CheckpointState, Module, bound_module, bound_state
from ort_lightning.ort._api import capi as _C
from ort_lightning.ort.options import session_options
from ort_lightning.ort.ort_files import nominal_summary_of, summary_of

__all__ = ["HeldState", "buffer_order", "copy_parameters", "read_state", "state_outlives"]

_CPU = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)


@dataclass(frozen=True)
class HeldState:
    """ORT's CheckpointState in memory, on its way to one build: a closed session's, or one read from `source`."""

    state: Any
    device: str | None = None
    source: str | None = None

    def summary(self) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, Any]]:
        """``(name, shape, requires_grad)`` per parameter, and the properties; refused if nominal."""
        return summary_of(self.state)

    def nominal_summary(self) -> tuple[list[str], dict[str, Any]] | None:
        """The parameter names and properties of a nominal state; None for a state that holds weights."""
        return nominal_summary_of(self.state)

    def values(self) -> dict[str, np.ndarray]:
        """Name -> a CPU copy of every tensor of the state (a ``CHECKPOINT_READ_ERRORS`` for a nominal state)."""
        bound = bound_state(self.state)
        return {name: np.array(bound.get_parameter(name).data.numpy(), copy=True) for name in bound.parameter_names()}


def read_state(path: os.PathLike[str] | str) -> HeldState:
    """Read an ORT checkpoint file once: its summary and the build it starts come from this one read."""
    source = os.fspath(path)
    return HeldState(CheckpointState.load_checkpoint(source), source=source)


def state_outlives(module: Module, state: CheckpointState) -> None:
    """Keep `state` alive until ORT's C++ Module under `module` is destroyed, whoever holds that Module last.

    NOTE: ORT 1.19.2's ``~Module`` writes into its CheckpointState, and a bound call keeps the C++
    Module alive past the Python one; freed the other way round, glibc aborts. Call it right after
    building the ``Module``, before anything takes a bound call of it.
    """
    # NOTE: finalize holds `state` until the Module's weak reference dies, after the Module's destructor. Not at
    # exit: a Module still alive then keeps its state.
    weakref.finalize(bound_module(module), _release, state).atexit = False


def _release(_: CheckpointState) -> None:
    """Nothing: the call only ends the finalizer's hold on its argument."""


def copy_parameters(module: Any, parameters: np.ndarray, *, trainable_only: bool = False) -> None:
    """Copy one float32 buffer into every parameter of `module`'s state (a nominal one too), in the graph's order.

    `trainable_only` fills the trainable parameters alone (ORT refuses that on a nominal state).

    Raises:
        ConfigurationError: for a buffer that is not float32 or not the size of the state.
    """
    expected = module.get_parameters_size(trainable_only)
    if parameters.dtype != np.float32 or parameters.ndim != 1 or parameters.size != expected:
        which = "trainable parameter" if trainable_only else "state tensor"
        raise ConfigurationError(
            f"Expected the parameters as one float32 buffer of {expected} values, but got {parameters.dtype} of shape "
            f"{parameters.shape}; pass a value for every {which} of these artifacts."
        )
    # NOTE: the C-level OrtValue shares the array's memory without keeping it alive: `values` stays referenced
    # until the copy is done (a strided `parameters` is copied into it first).
    values = np.ascontiguousarray(parameters)
    buffer = _C.OrtValue.ortvalue_from_numpy(values, _CPU)
    # NOTE: the 1.19.2 wrapper (Module.copy_buffer_to_parameters) hands the binding its Python
    # OrtValue, which the binding refuses; the binding itself takes the C-level one.
    bound_module(module).copy_buffer_to_parameters(buffer, trainable_only)


def buffer_order(training_model: os.PathLike[str] | str, checkpoint: os.PathLike[str] | str) -> list[str]:
    """The state's names in the order of ORT's contiguous parameter buffer, measured by copying ``0, 1, 2, ...`` in."""
    state = CheckpointState.load_checkpoint(os.fspath(checkpoint))
    module = Module(os.fspath(training_model), state, None, "cpu", session_options=session_options())
    state_outlives(module, state)
    # NOTE: float32 holds every offset below 2**24 exactly; above, rounding keeps the starts in order.
    copy_parameters(module, np.arange(module.get_parameters_size(False), dtype=np.float32))
    bound = bound_state(state)
    names = bound.parameter_names()
    starts = {name: float(np.asarray(bound.get_parameter(name).data.numpy()).ravel()[:1].sum()) for name in names}
    return sorted(names, key=lambda name: starts[name])
