"""ONNX Runtime's session options as ort-lightning sets them.

Errors-only logging, thread pools, spinning, custom operator libraries.

Example::

    >>> session_options(spinning=False).log_severity_level
    3
    >>> session_options().enable_mem_pattern  # they cost memory and no time: see the note below
    False
"""

from __future__ import annotations

import os
from typing import Any

from ort_lightning.errors import ConfigurationError
from ort_lightning.ort._api import SEVERITY_ERROR as _SEVERITY_ERROR
from ort_lightning.ort._api import capi as _C

__all__ = ["session_options"]


def session_options(
    custom_op_library: os.PathLike[str] | str | None = None, *, spinning: bool = True, intra_op_threads: int = 0
) -> Any:
    """Return `SessionOptions` that log errors only, with `custom_op_library` registered when given.

    Nothing is loaded unless the caller names a library: never implicitly from an artifacts folder.
    ``spinning=False`` makes ORT's idle intra-op threads sleep instead of spinning, which pays when
    several processes share the cores (DDP ranks on one CPU), or when torch runs right after ORT.
    ``intra_op_threads`` sizes ORT's intra-op pool; 0 leaves ORT's own default.

    Raises:
        ConfigurationError: for a library file that is missing or that ORT cannot load.
    """
    options = _C.SessionOptions()
    options.log_severity_level = _SEVERITY_ERROR
    options.intra_op_num_threads = intra_op_threads
    # NOTE: memory patterns off: ORT allocates a pattern at the second step beside the first step's arena chunks,
    # 20-36 MB more at peak on bert-tiny and resnet-tiny, for no faster a step (BENCHMARKS.md, "Memory of one
    # fit"). The heap corruption once blamed on this was ORT's C++ Module writing into a freed CheckpointState
    # (`session._state_outlives`).
    options.enable_mem_pattern = False
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if custom_op_library is not None:
        _register_custom_ops(options, os.fspath(custom_op_library))
    return options


def _register_custom_ops(options: Any, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigurationError(
            f"custom_op_library {path!r} does not exist or is not a file; pass the path of the shared library "
            "(.so/.dll/.dylib) that implements the graph's custom operators, or None."
        )
    try:
        options.register_custom_ops_library(path)
    except (RuntimeError, _C.Fail) as error:
        raise ConfigurationError(
            f"ONNX Runtime cannot load custom_op_library {path!r} ({' '.join(str(error).split())[:200]}); pass a "
            "shared library built against onnxruntime 1.19.2 for this platform, or None."
        ) from error
