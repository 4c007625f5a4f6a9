"""Property-based tests of the DLPack bridge: random shapes, dtypes and strides.

Every batch either round-trips exactly (same values, same dtype, and the same memory when the
tensor was already contiguous on the artifacts' device) or raises a `BatchError`; nothing
else may happen. (Batches on another device are covered where a GPU exists; empty tensors
are refused as empty batches, a case of their own.)
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ort_lightning.artifacts import TensorSpec
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import BatchError

DTYPES = ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"]

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn, dtype: str | None = None) -> torch.Tensor:
    """A random tensor of rank 0-4, possibly transposed, sliced with a step, or expanded."""
    name = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    base = (torch.rand(*shape, generator=generator) * 200 - 100) if shape else torch.tensor(seed * 0.5)
    tensor = base > 0 if name == "bool" else base.to(getattr(torch, name))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "expanded"]))
    if layout == "transposed" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, tensor.dim() - 1)
    elif layout == "strided" and tensor.dim() >= 1:
        tensor = torch.cat([tensor, tensor], dim=0)[::2]
    elif layout == "expanded" and tensor.dim() >= 1 and tensor.shape[0] == 1:
        tensor = tensor.expand(3, *tensor.shape[1:])
    return tensor


def _binder(tensor: torch.Tensor, dtype: str) -> BatchBinder:
    spec = TensorSpec("input", dtype, tuple(f"d{axis}" for axis in range(tensor.dim())))
    return BatchBinder((spec,), torch.device("cpu"), graph="training")


@SETTINGS
@given(tensors())
def test_a_matching_tensor_round_trips_exactly(tensor: torch.Tensor) -> None:
    dtype = str(tensor.dtype).removeprefix("torch.")
    contiguous = tensor.is_contiguous()
    back = to_torch(_binder(tensor, dtype)((tensor,))[0])
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert torch.equal(back, tensor)
    if contiguous and tensor.numel() > 0:
        assert back.data_ptr() == tensor.data_ptr(), "a contiguous CPU tensor must not be copied"


@SETTINGS
@given(tensors(), st.sampled_from(DTYPES))
def test_a_dtype_mismatch_raises_batch_error_naming_both(tensor: torch.Tensor, expected: str) -> None:
    given_dtype = str(tensor.dtype).removeprefix("torch.")
    binder = _binder(tensor, expected)
    if given_dtype == expected:
        assert torch.equal(to_torch(binder((tensor,))[0]), tensor)
        return
    with pytest.raises(BatchError, match=rf"expects dtype {expected}, but the batch gives {given_dtype}"):
        binder((tensor,))


@SETTINGS
@given(st.lists(tensors("float32"), min_size=0, max_size=4), st.integers(1, 3))
def test_a_wrong_number_of_tensors_raises_batch_error(batch: list[torch.Tensor], inputs: int) -> None:
    specs = tuple(TensorSpec(f"in{i}", "float32", ()) for i in range(inputs))
    binder = BatchBinder(specs, torch.device("cpu"), graph="training")
    if len(batch) == inputs:
        return
    with pytest.raises(BatchError, match=rf"expects {inputs} inputs .* the batch has {len(batch)} tensors"):
        binder(batch)
