"""`WeightOrder`: the one order of a model's flat weights, and Flower's ``ArrayRecord`` to that buffer and back.

Every runtime exchanges a device's weights as one float32 buffer: the state tensors in the
training graph's order of its inputs (neither a checkpoint's alphabetical listing nor the
manifest's ``parameter_order``). `flat` and `record` write each ``.npy`` header once and read the
data where it lies (Flower's ``np.load`` per tensor cost more than a small device's training).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import state_specs
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort import runtime as _ort

__all__ = ["WeightOrder", "check_buffer_order"]

#: Flower's ``stype`` of an ``Array`` that holds ``.npy`` bytes (``flwr.common.constant.SType.NUMPY``).
_NUMPY_STYPE = "numpy.ndarray"
_MAGIC = b"\x93NUMPY"


class WeightOrder:
    """The named tensors of one flat float32 buffer: ``(name, shape)`` of each, in the buffer's order."""

    def __init__(self, tensors: Sequence[tuple[str, Sequence[int]]]) -> None:
        self.tensors = [(name, tuple(int(dim) for dim in shape)) for name, shape in tensors]
        self._spans: list[tuple[str, tuple[int, ...], int, int]] = []
        at = 0
        for name, shape in self.tensors:
            size = math.prod(shape)
            self._spans.append((name, shape, at, at + size))
            at += size
        self.size = at
        self._headers = {shape: _header(shape) for _, shape in self.tensors}

    @classmethod
    def of(cls, artifacts: TrainingArtifacts) -> WeightOrder:
        """The state tensors of `artifacts` in the order the training graph takes them."""
        return cls([(spec.name, tuple(int(dim) for dim in spec.shape)) for spec in state_specs(artifacts)])

    @classmethod
    def checked(cls, artifacts: TrainingArtifacts, training_model: Path, checkpoint: Path) -> WeightOrder:
        """`of`, checked for a flat float32 buffer: all float32, in ONNX Runtime's order over these files.

        Raises:
            ConfigurationError: for a tensor that is not float32, or another order than ORT's.
        """
        wrong = [spec.name for spec in state_specs(artifacts) if spec.dtype != "float32"]
        if wrong:
            raise ConfigurationError(f"A browser device exchanges float32 weights, but the state tensors {wrong} of "
                                     f"{artifacts.directory} are not float32; train such a model in a simulated "
                                     "fleet.")
        order = cls.of(artifacts)
        check_buffer_order(order.names, training_model, checkpoint)
        return order

    @property
    def spans(self) -> dict[str, tuple[int, int]]:
        """Each tensor's ``(start, end)`` in the buffer, by name."""
        return {name: (start, end) for name, _, start, end in self._spans}

    @property
    def names(self) -> list[str]:
        """The tensors' names, in order."""
        return [name for name, _ in self.tensors]

    def flat(self, arrays: ArrayRecord) -> np.ndarray:
        """The record's tensors as one new float32 buffer in this order.

        Raises:
            ConfigurationError: for other names or shapes than the order's.
        """
        given = {name: tuple(arrays[name].shape) for name in arrays}
        if given != dict(self.tensors):
            raise ConfigurationError(
                f"The server sent the values {given}, but the device folder trains {dict(self.tensors)}; start the "
                "FleetServer from the artifacts the devices hold (one export)."
            )
        flat = np.empty(self.size, np.float32)
        for name, _, start, end in self._spans:
            flat[start:end] = _data(arrays[name], end - start)
        return flat

    def record(self, weights: np.ndarray) -> ArrayRecord:
        """`weights` (a flat float32 buffer of the order's size) as Flower's ``ArrayRecord``.

        Raises:
            ConfigurationError: for a buffer of another dtype or size.
        """
        if weights.dtype != np.float32 or weights.size != self.size:
            raise ConfigurationError(
                f"Expected a float32 buffer of {self.size} values, but got {weights.dtype} of {weights.size}; pass "
                "the device's weights (OrtDevice.get_weights)."
            )
        weights = np.ascontiguousarray(weights.reshape(-1))
        return ArrayRecord(array_dict={
            name: Array(dtype="float32", shape=shape, stype=_NUMPY_STYPE,
                        data=self._headers[shape] + weights[start:end].tobytes())
            for name, shape, start, end in self._spans
        })


def check_buffer_order(names: Sequence[str], training_model: Path, checkpoint: Path) -> None:
    """Check that `names` is the order of ONNX Runtime's contiguous buffer over these files.

    Raises:
        ConfigurationError: for another order (or other tensors).
    """
    measured = _ort.buffer_order(training_model, checkpoint)
    if list(names) != measured:
        raise ConfigurationError(f"The browser fleet declares its flat weights in the order {list(names)}, but ONNX "
                                 f"Runtime's parameter buffer over {training_model.name} and {checkpoint.name} holds "
                                 f"{measured}; a page would load each value into another tensor. Give the fleet the "
                                 "training graph and checkpoint of one export (export_artifacts, then "
                                 "prepare_for_web).")


def _header(shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-ordered little-endian float32 array of `shape`."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _data(array: Array, size: int) -> np.ndarray:
    """The float32 values of a Flower ``Array``, read where they lie when it is a plain ``.npy`` of float32."""
    data = array.data
    if array.stype == _NUMPY_STYPE and array.dtype == "float32" and data[:6] == _MAGIC:
        width = 2 if data[6] == 1 else 4
        start = 8 + width + int.from_bytes(data[8 : 8 + width], "little")
        header = data[8 + width : start]
        if b"'descr': '<f4'" in header and b"'fortran_order': False" in header and len(data) - start == 4 * size:
            return np.frombuffer(data, np.float32, count=size, offset=start)
    return array.numpy().astype(np.float32, copy=False).reshape(-1)
