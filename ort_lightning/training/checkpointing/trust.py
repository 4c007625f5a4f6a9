"""Nothing named in a checkpoint is loaded or run as code unless the caller names it again.

A ``.ckpt`` travels; one could name a shared library as ``custom_op_library``, which ONNX Runtime
would load. Such stored values are refused unless the caller passes the key again.

Example::

    >>> check_code_hyperparameters({"custom_op_library": "libops.so"}, {}, source="run.ckpt")
    Traceback (most recent call last):
    ...
    ort_lightning.errors.CheckpointError: run.ckpt names custom_op_library='libops.so' ...
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from ort_lightning.errors import CheckpointError

__all__ = ["CODE_KEYS", "check_code_hyperparameters"]

#: Arguments whose value is loaded or run: a library ONNX Runtime loads, factories, a file to start from.
CODE_KEYS = ("custom_op_library", "optimizer", "lr_scheduler", "checkpoint")
#: What to pass instead to load without the stored value.
_DEFAULTS = {"custom_op_library": "None", "optimizer": "None", "lr_scheduler": "'linear'", "checkpoint": "None"}
#: Values of these names are harmless as stored (what ``save_hyperparameters`` writes for the defaults).
_PLAIN_SCHEDULES = ("linear", "constant")
#: File endings of code: shared libraries and Python sources.
_CODE_SUFFIXES = (".so", ".dylib", ".dll", ".pyd", ".py", ".pyc")


def _names_code(key: str, value: Any) -> bool:
    if value is None:
        return False
    if key == "lr_scheduler":
        return not (isinstance(value, str) and value in _PLAIN_SCHEDULES)
    if key in CODE_KEYS:
        return True
    if isinstance(value, str):
        suffixes = PurePath(value).suffixes
        return any(suffix in _CODE_SUFFIXES for suffix in suffixes)
    return False


def check_code_hyperparameters(stored: Mapping[str, Any], given: Mapping[str, Any], *, source: object) -> None:
    """Refuse `stored` hyper-parameters that name code and are not in `given` (`CheckpointError`)."""
    for key, value in stored.items():
        if key in given or not _names_code(key, value):
            continue
        raise CheckpointError(
            f"{source} names {key}={value!r} among its hyper-parameters: something that would be loaded or run as "
            "code, and nothing from a checkpoint is loaded or run unless you ask. If you trust it, pass it again: "
            f"load_from_checkpoint(path, {key}=...); or pass {key}={_DEFAULTS.get(key, '<another value>')} to load "
            "without it."
        )
