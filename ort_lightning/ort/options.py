"""ONNX Runtime's session options as ort-lightning sets them.

Errors-only logging, thread pools, spinning, custom operator libraries. Everything else is ORT's
default, so that a session here computes what ORT's documented loop computes on a device.

Example::

    >>> session_options(spinning=False).log_severity_level
    3
    >>> session_options().enable_mem_pattern  # ORT's default: see the note in `session_options`
    True
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
    ``intra_op_threads`` sizes ORT's intra-op pool; 0 leaves ORT's own default. Neither changes a
    result: every setting the product builds trains as ORT's default ``SessionOptions()`` does, to
    the bit on the zoo and ORT's tutorial graphs (``tests/ort/test_session_numerics.py``). Everything
    else, memory patterns and the CPU arena included, is ORT's default, which is what a device runs.

    Raises:
        ConfigurationError: for a library file that is missing or that ORT cannot load.
    """
    options = _C.SessionOptions()
    options.log_severity_level = _SEVERITY_ERROR
    options.intra_op_num_threads = intra_op_threads
    # NOTE: memory patterns stay on, ORT's default, though off saves 10-36 MB at peak on bert-tiny, gpt2-tiny,
    # lstm and resnet-tiny for no slower a step (BENCHMARKS.md, "Memory of one fit"). They decide where ORT's
    # arena puts each buffer, and a graph that writes past a buffer hits another tensor without them:
    # generate_artifacts' MobileBertForMaskedLM does (its position embeddings' GatherGrad gets the batch's
    # gradient unsummed), and with patterns off its losses ended 4 steps 3.7e-5 off ORT's documented loop
    # (1.9e-6 with them), its word embeddings 4.9e-3 (4.3e-4).
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
