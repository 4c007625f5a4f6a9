"""A device's flat float32 buffer to Flower's ``ArrayRecord`` and back, held to Flower's own conversions.

The reference is Flower itself: ``Array.from_numpy_ndarray`` (``np.save``) for the bytes a record
holds, ``Array.numpy()`` (``np.load``) for the values a record gives.
"""

from __future__ import annotations

import numpy as np
import pytest

from ort_lightning.errors import ConfigurationError

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Array, ArrayRecord  # noqa: E402

from ort_lightning.fleet.devices.weight_order import WeightOrder  # noqa: E402

ORDER = [("fc1.weight", (16, 64)), ("fc1.bias", (16,)), ("fc2.weight", (10, 16)), ("fc2.bias", (10,)), ("s", ())]
SIZE = 16 * 64 + 16 + 10 * 16 + 10 + 1


def _weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SIZE).astype(np.float32)


def _flower_record(weights: np.ndarray) -> ArrayRecord:
    """What Flower writes for the same tensors: one ``np.save`` each."""
    named, at = {}, 0
    for name, shape in ORDER:
        size = int(np.prod(shape))
        named[name] = Array.from_numpy_ndarray(weights[at : at + size].reshape(shape).copy())
        at += size
    return ArrayRecord(array_dict=named)


def test_record_holds_the_bytes_flower_writes() -> None:
    weights = _weights()
    ours, flowers = WeightOrder(ORDER).record(weights), _flower_record(weights)
    assert list(ours) == [name for name, _ in ORDER]
    for name, _ in ORDER:
        assert (ours[name].dtype, ours[name].shape, ours[name].stype) == (
            flowers[name].dtype, flowers[name].shape, flowers[name].stype)
        assert ours[name].data == flowers[name].data


def test_flat_equals_flowers_values_in_order() -> None:
    weights = _weights(1)
    flat = WeightOrder(ORDER).flat(_flower_record(weights))
    assert flat.dtype == np.float32
    np.testing.assert_array_equal(flat, weights)
    expected = np.concatenate([_flower_record(weights)[name].numpy().ravel() for name, _ in ORDER])
    np.testing.assert_array_equal(flat, expected)


@pytest.mark.parametrize("kind", ["float64", "big-endian", "fortran"])
def test_other_encodings_take_flowers_conversion(kind: str) -> None:
    """A server that sends float64, big-endian or Fortran-ordered tensors gives the same float32 values."""
    weights = _weights(2)
    named, at = {}, 0
    for name, shape in ORDER:
        size = int(np.prod(shape))
        value = weights[at : at + size].reshape(shape)
        at += size
        if kind == "float64":
            value = value.astype(np.float64)
        elif kind == "big-endian":
            value = value.astype(">f4")
        elif value.ndim == 2:  # np.asfortranarray would make a scalar 1-d
            value = np.asfortranarray(value)
        named[name] = Array.from_numpy_ndarray(value)
    np.testing.assert_array_equal(WeightOrder(ORDER).flat(ArrayRecord(array_dict=named)), weights)


def test_flat_is_a_copy_the_record_does_not_share() -> None:
    record = WeightOrder(ORDER).record(_weights(3))
    flat = WeightOrder(ORDER).flat(record)
    flat[:] = 0
    assert np.abs(WeightOrder(ORDER).flat(record)).sum() > 0


def test_values_of_another_layout_are_refused_by_name() -> None:
    other = WeightOrder([("fc1.weight", (8, 64))]).record(np.zeros(8 * 64, np.float32))
    with pytest.raises(ConfigurationError, match=r"sent the values \{'fc1.weight': \(8, 64\)\}, but the device folder "
                                                 r"trains .*start the FleetServer from the artifacts"):
        WeightOrder(ORDER).flat(other)


@pytest.mark.parametrize("weights", [np.zeros(SIZE, np.float64), np.zeros(SIZE - 1, np.float32)])
def test_a_buffer_of_another_dtype_or_size_is_refused(weights: np.ndarray) -> None:
    with pytest.raises(ConfigurationError, match=rf"Expected a float32 buffer of {SIZE} values, but got"):
        WeightOrder(ORDER).record(weights)
