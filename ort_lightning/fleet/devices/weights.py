"""Flower's ``ArrayRecord`` to one float32 buffer and back, without ``np.load`` and ``np.save`` per tensor.

A Flower ``Array`` holds a tensor as the bytes of a ``.npy`` file (``stype`` ``"numpy.ndarray"``).
``Array.numpy()`` parses each header with ``np.load`` (an ``ast.literal_eval``), and
``ArrayRecord(state_dict)`` writes each tensor with ``np.save``: together about 1 ms of a simulated
device's round for four tensors, more than its training. A device's values always have the same
names, shapes and dtype, so `WeightLayout` writes each header once and reads the data where it
lies. Anything else than a little-endian float32, C-ordered ``.npy`` falls back to Flower's own
conversion, so that the numbers are the same either way.

Example::

    >>> layout = WeightLayout([("w", (2, 3)), ("b", (2,))])
    >>> record = layout.record(np.arange(8, dtype=np.float32))
    >>> record["w"].numpy().tolist(), record["b"].numpy().tolist()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [6.0, 7.0])
    >>> layout.flat(record).tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord

from ort_lightning.errors import ConfigurationError

__all__ = ["WeightLayout"]

#: Flower's ``stype`` of an ``Array`` that holds ``.npy`` bytes (``flwr.common.constant.SType.NUMPY``).
_NUMPY_STYPE = "numpy.ndarray"
_MAGIC = b"\x93NUMPY"


class WeightLayout:
    """The named tensors of one flat float32 buffer, in its order.

    Args:
        order: ``(name, shape)`` of every tensor, in the buffer's order.
    """

    def __init__(self, order: Sequence[tuple[str, tuple[int, ...]]]) -> None:
        self.order = [(name, tuple(shape)) for name, shape in order]
        self._spans: list[tuple[str, tuple[int, ...], int, int]] = []
        at = 0
        for name, shape in self.order:
            size = math.prod(shape)
            self._spans.append((name, shape, at, at + size))
            at += size
        self.size = at
        self._headers = {shape: _header(shape) for _, shape in self.order}

    def flat(self, arrays: ArrayRecord) -> np.ndarray:
        """The record's tensors as one new float32 buffer in the layout's order.

        Raises:
            ConfigurationError: for a record of other names or shapes than the layout's.
        """
        given = {name: tuple(arrays[name].shape) for name in arrays}
        if given != dict(self.order):
            raise ConfigurationError(
                f"The server sent the values {given}, but the device folder trains {dict(self.order)}; start the "
                "FleetServer from the artifacts the devices hold (one export)."
            )
        flat = np.empty(self.size, np.float32)
        for name, _, start, end in self._spans:
            flat[start:end] = _data(arrays[name], end - start)
        return flat

    def record(self, weights: np.ndarray) -> ArrayRecord:
        """`weights` (a flat float32 buffer of the layout's size) as Flower's ``ArrayRecord``, one ``Array`` a tensor.

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
