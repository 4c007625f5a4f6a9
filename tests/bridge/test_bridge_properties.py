"""Property-based tests of the DLPack bridge: random shapes, dtypes and strides.

Every batch either round-trips exactly (same values, same dtype, and the same memory when the
tensor was already contiguous on the artifacts' device) or raises a `BatchError`; nothing
else may happen. Through a real training session, a wrong rank or fixed dimension is refused
by ORT and reported as a `BatchError`; empty tensors are refused as empty batches before ORT
sees them. (Batches on another device are covered where a GPU exists.)
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ort_lightning import ORTLightningModule
from ort_lightning.artifacts import TensorSpec
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import BatchError
from tests.conftest import Exported

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


# ----------------------------------------------------------------------------- through a real training session
@pytest.fixture(scope="module")
def mlp_module(mlp_adamw: Exported) -> ORTLightningModule:
    return ORTLightningModule(mlp_adamw.artifacts)


shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(input_shape=shapes, label_shape=shapes)
def test_a_rank_or_fixed_dimension_mismatch_raises_batch_error(
    mlp_module: ORTLightningModule, input_shape: list[int], label_shape: list[int]
) -> None:
    # The training graph takes input (batch, 4) float32 and labels (batch,) int64.
    batch = input_shape[0] if input_shape else 1
    fits_input = len(input_shape) == 2 and input_shape[1] == 4
    fits_labels = len(label_shape) == 1
    labels = torch.zeros(batch if fits_labels else label_shape, dtype=torch.int64) if label_shape else torch.tensor(0)
    tensors = [torch.rand(tuple(input_shape)), labels]
    binder, session = mlp_module.live_session.views.train_inputs, mlp_module.ort_session
    if fits_input and fits_labels:
        loss = to_torch(binder.run(session.train_step, tensors)[0])
        assert torch.isfinite(loss)
        return
    wrong = "input" if not fits_input else "labels"
    with pytest.raises(BatchError, match=rf"Input '{wrong}' of the training graph expects shape .*but the batch gives"):
        binder.run(session.train_step, tensors)


@SETTINGS
@given(tensors("float32"), st.integers(0, 3))
def test_an_empty_tensor_raises_the_empty_batch_error(tensor: torch.Tensor, axis: int) -> None:
    empty = tensor.reshape(1, *tensor.shape)[:0] if axis >= tensor.dim() else tensor.narrow(axis, 0, 0)
    with pytest.raises(BatchError, match=r"Input 'input' of the training graph is empty .*0 elements.*drop_last=True"):
        _binder(empty, "float32")((empty,))
