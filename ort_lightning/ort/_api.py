"""The import of ONNX Runtime's training API: the one place ``onnxruntime`` is imported.

The other modules of this package take ONNX Runtime's objects from here; a missing or wrong
ONNX Runtime build fails here with the install command. ONNX Runtime logs at INFO by default in
this build: its default logger is set to errors once, quietly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_INSTALL_HINT = (
    "ort-lightning needs ONNX Runtime's training package (onnxruntime-training 1.19.2). Install one of:\n"
    '  pip install "ort-lightning[cpu]"   # onnxruntime-training-cpu==1.19.2\n'
    '  pip install "ort-lightning[cuda]"  # onnxruntime-training==1.19.2 (CUDA build, Python 3.10-3.11 only)\n'
    "Install exactly one, and never beside plain `onnxruntime`: all three provide the same package."
)


def _below_warning_from_ort(record: logging.LogRecord) -> bool:
    """False for an INFO or DEBUG record that ONNX Runtime's own Python code sends: it is dropped."""
    return record.levelno >= logging.WARNING or "onnxruntime" not in Path(record.pathname).parts


@contextlib.contextmanager
def root_logger_kept() -> Iterator[None]:
    """Give the root logger back with the handlers and level it had; drop ORT's INFO records meanwhile.

    NOTE: ONNX Runtime configures the root logger, which a library must never do: importing its
    tools runs ``basicConfig`` of the logging module (``onnxruntime/tools/logger.py``, the quantization package),
    and ``generate_artifacts`` logs through the module-level ``logging.info``, which calls
    ``basicConfig`` when the root logger has no handler. The handler left behind prints every
    record that propagates to the root, so Flower's and Lightning's lines appear twice. Its INFO
    lines ("Saved training model to ...") would also reach a handler the user set up at INFO;
    ort-lightning reports what it wrote itself, so they are dropped while ORT runs.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    root.addFilter(_below_warning_from_ort)
    try:
        yield
    finally:
        root.removeFilter(_below_warning_from_ort)
        root.handlers[:] = handlers
        root.setLevel(level)


with root_logger_kept():
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state as _C
        from onnxruntime.tools import convert_onnx_models_to_ort as _converter
        from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs as _fbs
        from onnxruntime.training import artifacts as _artifacts
        from onnxruntime.training import onnxblock
        from onnxruntime.training.api import CheckpointState, Module, Optimizer
        from onnxruntime.training.onnxblock import _training_graph_utils
    except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
        raise ImportError(_INSTALL_HINT) from error


# NOTE: this build logs at INFO by default; ERROR keeps a user's console readable.
SEVERITY_ERROR = 3
onnxruntime.set_default_logger_severity(SEVERITY_ERROR)

__all__ = [
    "SEVERITY_ERROR",
    "bound_module",
    "bound_optimizer",
    "bound_state",
    "CheckpointState",
    "Module",
    "Optimizer",
    "artifacts_api",
    "capi",
    "onnxblock",
    "onnxruntime",
    "ort_converter",
    "ort_flatbuffers",
    "root_logger_kept",
    "training_graph_utils",
]

capi = _C
artifacts_api = _artifacts
ort_converter = _converter
#: The generated readers of ONNX Runtime's ``.ort`` format (flatbuffers), shipped in its ``tools`` package.
ort_flatbuffers = _fbs
training_graph_utils = _training_graph_utils


# NOTE: ORT 1.19.2's Python wrappers (``onnxruntime.training.api``) keep their C++ objects in ``_state``,
# ``_model`` and ``_optimizer``; what this package needs of them exists only there (the OrtValue steps, a
# checkpoint's save and properties, ``copy_buffer_to_parameters`` taking a C-level OrtValue). These three
# are the one place that reaches under the wrappers: a release that renames them is this module's business.
def bound_state(state: CheckpointState) -> Any:
    """The C++ CheckpointState under ORT's Python `state`."""
    return state._state


def bound_module(module: Module) -> Any:
    """The C++ Module under ORT's Python `module` (its ``train_step_with_ort_values``, ``lazy_reset_grad``, ...)."""
    return module._model


def bound_optimizer(optimizer: Optimizer) -> Any:
    """The C++ Optimizer under ORT's Python `optimizer` (its ``optimizer_step``, learning rate)."""
    return optimizer._optimizer
