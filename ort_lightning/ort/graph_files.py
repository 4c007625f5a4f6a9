"""The ONNX graphs of training artifacts as files: reading one with a clear error, and ORT's own inputs.

Example::

    >>> names = ["input", "fc.weight", "fc.weight_grad.accumulation.buffer", "lazy_reset_grad"]
    >>> sorted(ort_inputs(names)), trained_parameters(names)
    (['fc.weight_grad.accumulation.buffer', 'lazy_reset_grad'], {'fc.weight'})
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import onnx
from google.protobuf.message import DecodeError
from onnx.checker import ValidationError

from ort_lightning.errors import ArtifactError, ORTLightningError

__all__ = ["GRAD_BUFFER", "GRAD_OUT", "READ_ERRORS", "RESET", "load_graph", "ort_inputs", "trained_parameters"]

#: The suffix of the gradient buffer ORT's training graph takes (and updates) for each trained parameter.
GRAD_BUFFER = "_grad.accumulation.buffer"
#: The suffix of the training graph's output that says a gradient buffer was updated.
GRAD_OUT = "_grad.accumulation.out"
#: The training graph's input that tells it to start accumulating gradients afresh.
RESET = "lazy_reset_grad"

#: What ``onnx.load`` raises for a file it cannot read: a damaged or truncated protobuf (DecodeError), a
#: missing or unreadable file (OSError), external data missing or outside the model's folder (ValidationError).
READ_ERRORS = (DecodeError, OSError, ValidationError)


def ort_inputs(input_names: Iterable[str]) -> set[str]:
    """The inputs of a training graph that ``generate_artifacts`` adds: the gradient buffers and the reset flag."""
    return {name for name in input_names if name.endswith(GRAD_BUFFER) or name == RESET}


def trained_parameters(input_names: Iterable[str]) -> set[str]:
    """The parameters a training graph trains: those whose gradient buffer it takes."""
    return {name[: -len(GRAD_BUFFER)] for name in input_names if name.endswith(GRAD_BUFFER)}


def load_graph(
    path: os.PathLike[str] | str,
    *,
    advice: str,
    load_external_data: bool = False,
    error: type[ORTLightningError] = ArtifactError,
) -> onnx.ModelProto:
    """Read an ONNX file, or raise `error` (`ArtifactError`) saying it is not a readable ONNX model, and `advice`."""
    try:
        return onnx.load(os.fspath(path), load_external_data=load_external_data)
    except READ_ERRORS as cause:
        raise error(f"{os.fspath(path)} is not a readable ONNX model ({cause}); {advice}.") from cause
