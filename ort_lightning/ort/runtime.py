"""ONNX Runtime's training API as the rest of the package sees it: one surface, five modules.

`_api` imports ONNX Runtime (the only import of it), `generate` writes artifacts, `session`
assembles the objects that train them, `state` holds a CheckpointState in memory, `files` reads
ORT's files. This module gathers their surface, so that an ORT upgrade, or its absence, is this
package's business alone.

Example::

    >>> from ort_lightning.ort import runtime as _ort
    >>> _ort.parse_device("cpu")
    ('cpu', 0)
"""

from __future__ import annotations

from collections.abc import Callable

from ort_lightning.ort._api import capi as _C
from ort_lightning.ort._api import onnxruntime
from ort_lightning.ort.checkpoint_state import HeldState, buffer_order, read_state
from ort_lightning.ort.generate import OPTIMIZER_NODES, generate, is_block, optimizer_kind_of, write_device_files
from ort_lightning.ort.options import session_options
from ort_lightning.ort.ort_files import (
    CHECKPOINT_READ_ERRORS,
    WRITE_ERRORS,
    checkpoint_summary,
    nominal_summary,
    optimizer_kind_in,
    ort_graph_io,
    ort_metadata,
    ort_node_attributes,
)
from ort_lightning.ort.session import SessionSettings, TrainingSession, assemble, parse_device

__all__ = [
    "CHECKPOINT_READ_ERRORS",
    "HeldState",
    "OPTIMIZER_NODES",
    "OrtValue",
    "OrtValueVector",
    "SessionSettings",
    "TrainingSession",
    "WRITE_ERRORS",
    "assemble",
    "buffer_order",
    "checkpoint_summary",
    "generate",
    "is_block",
    "nominal_summary",
    "optimizer_kind_in",
    "optimizer_kind_of",
    "ort_graph_io",
    "ort_metadata",
    "ort_node_attributes",
    "parse_device",
    "read_state",
    "session_options",
    "set_seed",
    "versions",
    "write_device_files",
]

OrtValue = _C.OrtValue
OrtValueVector = _C.OrtValueVector


#: Seed ONNX Runtime's process-wide random generators (Dropout's among them); ORT's own function,
#: called before every training step, so no wrapper runs there.
set_seed: Callable[[int], None] = onnxruntime.set_seed


def versions() -> dict[str, str]:
    """Return the ONNX Runtime version, for the manifest."""
    return {"onnxruntime": onnxruntime.__version__}
