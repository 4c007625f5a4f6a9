"""The import of ONNX Runtime's training API: the one place ``onnxruntime`` is imported.

The other modules of this package take ONNX Runtime's objects from here; a missing or wrong
ONNX Runtime build fails here with the install command. ONNX Runtime logs at INFO by default in
this build: its default logger is set to errors once, quietly.
"""

from __future__ import annotations

import logging

_INSTALL_HINT = (
    "ort-lightning needs ONNX Runtime's training package (onnxruntime-training 1.19.2). Install one of:\n"
    '  pip install "ort-lightning[cpu]"   # onnxruntime-training-cpu==1.19.2\n'
    '  pip install "ort-lightning[cuda]"  # onnxruntime-training==1.19.2 (CUDA build, Python 3.10-3.11 only)\n'
    "Install exactly one, and never beside plain `onnxruntime`: all three provide the same package."
)

# NOTE: importing onnxruntime runs logging.basicConfig(level=INFO) (its quantization package
# does), which would print every library's INFO records, Lightning's included, twice; the
# root logger is given back as the user had it.
_root_logger = logging.getLogger()
_root_handlers, _root_level = list(_root_logger.handlers), _root_logger.level
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
finally:
    _root_logger.handlers[:] = _root_handlers
    _root_logger.setLevel(_root_level)


# NOTE: this build logs at INFO by default; ERROR keeps a user's console readable.
SEVERITY_ERROR = 3
onnxruntime.set_default_logger_severity(SEVERITY_ERROR)

__all__ = [
    "SEVERITY_ERROR",
    "CheckpointState",
    "Module",
    "Optimizer",
    "artifacts_api",
    "capi",
    "onnxblock",
    "onnxruntime",
    "ort_converter",
    "ort_flatbuffers",
    "training_graph_utils",
]

capi = _C
artifacts_api = _artifacts
ort_converter = _converter
#: The generated readers of ONNX Runtime's ``.ort`` format (flatbuffers), shipped in its ``tools`` package.
ort_flatbuffers = _fbs
training_graph_utils = _training_graph_utils
