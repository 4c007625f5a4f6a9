"""ONNX Runtime's session options as ort-lightning sets them; everything else is ORT's default, as on a device.

Example::

    >>> session_options(spinning=False).log_severity_level
    3
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

    `spinning` and `intra_op_threads` (0: ORT's default) change no result
    (``tests/test_session_numerics.py``); nothing is loaded that the caller did not name.

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
