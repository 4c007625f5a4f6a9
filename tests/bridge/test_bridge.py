"""The DLPack bridge: batches into OrtValues without copies, and torch views of ORT's parameters.

Numbers are checked against plain torch (autograd on the pristine reference model), never
against ort_lightning itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F

from ort_lightning import export_artifacts
from ort_lightning.artifacts import TensorSpec, TrainingArtifacts
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import BatchError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.session.parameters import ParameterView, parameter_views
from tests.conftest import MLP, Exported, blobs

_CPU = torch.device("cpu")


def _session(artifacts: TrainingArtifacts) -> _ort.TrainingSession:
    return _ort.assemble(
        training_model=artifacts.training_model,
        eval_model=artifacts.eval_model,
        optimizer_model=artifacts.optimizer_model,
        checkpoint=artifacts.checkpoint,
    )


def _binder(artifacts: TrainingArtifacts, graph: str = "training") -> BatchBinder:
    return BatchBinder(artifacts.manifest.graph_inputs, _CPU, graph=graph)


def _views(session: _ort.TrainingSession) -> dict[str, ParameterView]:
    return {view.name: view for view in parameter_views(session)}


def _torch_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain torch autograd: gradients of the mean cross-entropy of `model` on one batch."""
    model.zero_grad()
    F.cross_entropy(model(x), y, reduction="mean").backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


# ------------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize(
    "make_input",
    [lambda x: x, lambda x: torch.cat([torch.zeros(3, 4), x])[3:]],
    ids=["fresh", "row-slice-with-storage-offset"],
)
def test_batch_is_bound_without_copy(
    mlp_adamw: Exported, make_input: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x, y = blobs(8, seed=0)
    x = make_input(x)
    assert x.is_contiguous()
    inputs = _binder(mlp_adamw.artifacts)((x, y))
    assert len(inputs) == 2
    for i, tensor in enumerate((x, y)):
        bound = to_torch(inputs[i])
        assert bound.data_ptr() == tensor.data_ptr()
        assert bound.dtype == tensor.dtype
        torch.testing.assert_close(bound, tensor, rtol=0, atol=0)


_ROUND_TRIP = {
    "float32": torch.tensor([[-1.5, 0.0, 3.25e-30], [float("inf"), -0.0, 1e30]], dtype=torch.float32),
    "float64": torch.tensor([1 / 3, -2.0**-1070, 1e300], dtype=torch.float64),
    "int64": torch.tensor([-(2**62), -1, 0, 2**40 + 7, 2**63 - 1], dtype=torch.int64),
    "int32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
    "bool": torch.tensor([[True, False], [False, True], [True, True]]),
}


@pytest.mark.parametrize("dtype", list(_ROUND_TRIP), ids=str)
def test_tensor_round_trips_exactly(dtype: str) -> None:
    tensor = _ROUND_TRIP[dtype]
    binder = BatchBinder((TensorSpec("value", dtype, tuple(tensor.shape)),), _CPU, graph="training")
    value = binder((tensor,))[0]
    assert value.data_type() == f"tensor({dtype.replace('float32', 'float').replace('float64', 'double')})"
    back = to_torch(value)
    assert back.dtype == tensor.dtype
    assert back.data_ptr() == tensor.data_ptr()
    assert torch.equal(back, tensor)


def test_bool_input_reaches_an_onnx_graph_as_bool() -> None:
    """A bool mask bound by BatchBinder drives Where and Not in a real ONNX Runtime session."""
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Where", ["mask", "x", "zeros"], ["kept"]),
            onnx.helper.make_node("Not", ["mask"], ["inverted"]),
        ],
        "masking",
        [
            onnx.helper.make_tensor_value_info("mask", onnx.TensorProto.BOOL, ["n"]),
            onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"]),
        ],
        [
            onnx.helper.make_tensor_value_info("kept", onnx.TensorProto.FLOAT, ["n"]),
            onnx.helper.make_tensor_value_info("inverted", onnx.TensorProto.BOOL, ["n"]),
        ],
        [onnx.numpy_helper.from_array(np.zeros(1, dtype=np.float32), "zeros")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    specs = (TensorSpec("mask", "bool", ("n",)), TensorSpec("x", "float32", ("n",)))
    mask = torch.tensor([True, False, True, False, False])
    x = torch.arange(1.0, 6.0)

    inputs = BatchBinder(specs, _CPU, graph="eval")((mask, x))
    feeds = {"mask": onnxruntime.OrtValue(inputs[0]), "x": onnxruntime.OrtValue(inputs[1])}
    kept, inverted = session.run_with_ort_values(["kept", "inverted"], feeds)

    torch.testing.assert_close(to_torch(kept._ortvalue), torch.where(mask, x, 0.0), rtol=0, atol=0)
    assert to_torch(inverted._ortvalue).dtype == torch.bool
    assert torch.equal(to_torch(inverted._ortvalue), ~mask)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _every_other_column(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, torch.full_like(x, 99.0)], dim=2).flatten(1)[:, ::2]


def _expanded_row(x: torch.Tensor) -> torch.Tensor:
    return x[:1].expand(len(x), -1)


@pytest.mark.parametrize(
    "make_strided",
    [_transposed, _every_other_column, _expanded_row],
    ids=["transposed", "sliced-columns", "expanded"],
)
def test_non_contiguous_input_gives_the_values_of_contiguous(
    mlp_adamw: Exported, make_strided: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x, y = blobs(8, seed=1)
    strided = make_strided(x)
    assert not strided.is_contiguous()
    binder = _binder(mlp_adamw.artifacts, graph="eval")
    bound = to_torch(binder((strided, y))[0])
    torch.testing.assert_close(bound, strided.contiguous(), rtol=0, atol=0)

    session = _session(mlp_adamw.artifacts)
    loss, logits = (to_torch(v).clone() for v in session.eval_step(binder((strided, y))))
    dense = binder((strided.contiguous(), y))
    expected_loss, expected_logits = (to_torch(v) for v in session.eval_step(dense))
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=0)
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)


def test_transposed_images_give_the_values_of_contiguous(bn_dropout_cnn: Exported) -> None:
    images = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(2)).transpose(2, 3)
    assert not images.is_contiguous()
    labels = torch.tensor([0, 3, 9, 5])
    binder = _binder(bn_dropout_cnn.artifacts, graph="eval")
    session = _session(bn_dropout_cnn.artifacts)
    strided = [to_torch(v).clone() for v in session.eval_step(binder((images, labels)))]
    dense = [to_torch(v) for v in session.eval_step(binder((images.contiguous(), labels)))]
    for got, expected in zip(strided, dense, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_tensor_requiring_grad_is_bound_without_copy(mlp_adamw: Exported) -> None:
    x, y = blobs(8, seed=2)
    x.requires_grad_(True)
    inputs = _binder(mlp_adamw.artifacts)((x, y))
    bound = to_torch(inputs[0])
    assert bound.data_ptr() == x.data_ptr()
    assert not bound.requires_grad
    torch.testing.assert_close(bound, x.detach(), rtol=0, atol=0)
    loss = to_torch(_session(mlp_adamw.artifacts).train_step(inputs)[0])
    expected = F.cross_entropy(mlp_adamw.reference()(x), y)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-6)


def test_dict_batch_is_ordered_by_input_name(mlp_adamw: Exported) -> None:
    x, y = blobs(8, seed=3)
    inputs = _binder(mlp_adamw.artifacts)({"labels": y, "unused": torch.ones(1), "input": x})
    assert to_torch(inputs[0]).data_ptr() == x.data_ptr()
    assert to_torch(inputs[1]).data_ptr() == y.data_ptr()


@pytest.mark.parametrize(
    ("change", "given", "expected"),
    [
        (lambda x, y: (x.double(), y), "float64", "float32"),
        (lambda x, y: (x.half(), y), "float16", "float32"),
        (lambda x, y: (x, y.int()), "int32", "int64"),
        (lambda x, y: (x, y.float()), "float32", "int64"),
    ],
    ids=["double-input", "half-input", "int32-labels", "float-labels"],
)
def test_dtype_mismatch_names_input_and_dtypes(
    mlp_adamw: Exported, change: Callable[..., tuple[torch.Tensor, ...]], given: str, expected: str
) -> None:
    x, y = blobs(4, seed=4)
    name = "input" if expected == "float32" else "labels"
    message = (
        rf"Input '{name}' of the training graph expects dtype {expected}, but the batch gives {given}; "
        rf"convert it .*tensor\.to\(torch\.{expected}\)"
    )
    with pytest.raises(BatchError, match=message):
        _binder(mlp_adamw.artifacts)(change(x, y))


@pytest.mark.parametrize(
    ("x_shape", "y_shape", "name", "expected", "given"),
    [
        ((4, 5), (4,), "input", r"\(batch, 4\)", r"\(4, 5\)"),
        ((4,), (4,), "input", r"\(batch, 4\)", r"\(4,\)"),
        ((4, 4), (4, 1), "labels", r"\(batch,\)", r"\(4, 1\)"),
    ],
    ids=["wrong-width", "missing-batch-dim", "labels-as-column"],
)
def test_wrong_shape_names_input_and_shapes(
    mlp_adamw: Exported,
    x_shape: tuple[int, ...],
    y_shape: tuple[int, ...],
    name: str,
    expected: str,
    given: str,
) -> None:
    batch = (torch.zeros(x_shape), torch.zeros(y_shape, dtype=torch.int64))
    message = (
        rf"Input '{name}' of the training graph expects shape {expected}, but the batch gives {given}; "
        "reshape it in your Dataset or collate_fn"
    )
    binder = _binder(mlp_adamw.artifacts)
    with pytest.raises(BatchError, match=message):
        binder.run(_session(mlp_adamw.artifacts).train_step, binder.ordered(batch))


def test_batch_size_is_free(mlp_adamw: Exported) -> None:
    session = _session(mlp_adamw.artifacts)
    for size in (1, 5, 33):
        x, y = blobs(size, seed=size)
        loss = to_torch(session.eval_step(_binder(mlp_adamw.artifacts, "eval")((x, y)))[0])
        expected = F.cross_entropy(mlp_adamw.reference()(x), y).detach()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("count", [1, 3], ids=["one-tensor", "three-tensors"])
def test_wrong_number_of_tensors_names_the_inputs(mlp_adamw: Exported, count: int) -> None:
    x, y = blobs(4, seed=5)
    batch = [x, y, y][:count]
    message = (
        rf"training graph expects 2 inputs \['input', 'labels'\], the batch has {count} tensors; "
        r"return \(input, labels\) from your Dataset or pass a dict keyed by input name"
    )
    with pytest.raises(BatchError, match=message):
        _binder(mlp_adamw.artifacts)(batch)


def test_dict_batch_missing_a_key_names_it(mlp_adamw: Exported) -> None:
    x, _ = blobs(4, seed=6)
    message = (
        r"training graph expects inputs \['input', 'labels'\], the batch dict lacks \['labels'\] "
        r"\(it has \['input', 'y'\]\); key the dict by input name"
    )
    with pytest.raises(BatchError, match=message):
        _binder(mlp_adamw.artifacts)({"input": x, "y": torch.zeros(4, dtype=torch.int64)})


@pytest.mark.parametrize(
    ("labels", "type_name"),
    [([0, 1, 2, 0], "list"), (np.zeros(4, dtype=np.int64), "ndarray"), (None, "NoneType")],
    ids=["list", "numpy", "none"],
)
def test_non_tensor_element_is_refused(mlp_adamw: Exported, labels: object, type_name: str) -> None:
    x, _ = blobs(4, seed=7)
    message = rf"Input 'labels' of the training graph must be a torch\.Tensor, but got {type_name}"
    with pytest.raises(BatchError, match=message):
        _binder(mlp_adamw.artifacts)((x, labels))


@pytest.mark.parametrize("batch", [3, "input", None], ids=["int", "str", "none"])
def test_batch_that_is_not_a_sequence_or_dict_is_refused(mlp_adamw: Exported, batch: object) -> None:
    message = (
        r"expects a tuple/list of tensors \['input', 'labels'\] or a dict keyed by those names, "
        rf"but the batch is a {type(batch).__name__}; return tensors from your Dataset"
    )
    with pytest.raises(BatchError, match=message):
        _binder(mlp_adamw.artifacts)(batch)


# ------------------------------------------------------------------------------ parameters and grads
def _add_to_bias(parameters: dict[str, torch.Tensor]) -> None:
    parameters["fc2.bias"] += torch.tensor([1.0, -2.0, 0.5])


def _halve_weight(parameters: dict[str, torch.Tensor]) -> None:
    parameters["fc1.weight"].mul_(0.5)


def _zero_hidden_unit(parameters: dict[str, torch.Tensor]) -> None:
    parameters["fc1.weight"][3].zero_()
    parameters["fc1.bias"][3] = 0.0


@pytest.mark.parametrize(
    "write", [_add_to_bias, _halve_weight, _zero_hidden_unit], ids=["add-bias", "halve-weight", "zero-unit"]
)
def test_writing_a_data_view_changes_ort_outputs_as_torch_predicts(
    mlp_adamw: Exported, write: Callable[[dict[str, torch.Tensor]], None]
) -> None:
    session = _session(mlp_adamw.artifacts)
    x, y = blobs(16, seed=8)
    reference = mlp_adamw.reference()
    with torch.no_grad():
        write({name: view.data for name, view in _views(session).items()})
        write(dict(reference.named_parameters()))
        expected_logits = reference(x)

    loss, logits = (to_torch(v) for v in session.eval_step(_binder(mlp_adamw.artifacts, "eval")((x, y))))

    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(expected_logits, y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fixture", ["mlp_adamw", "mlp_sgd"])
def test_grad_views_equal_torch_autograd(request: pytest.FixtureRequest, fixture: str) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    session = _session(exported.artifacts)
    x, y = blobs(16, seed=9)
    loss = to_torch(session.train_step(_binder(exported.artifacts)((x, y)))[0])

    reference = exported.reference()
    expected = _torch_grads(reference, x, y)
    views = _views(session)
    assert sorted(views) == sorted(expected)
    for name, view in views.items():
        assert view.trainable
        assert view.grad is not None
        torch.testing.assert_close(view.grad, expected[name], rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, F.cross_entropy(reference(x), y).detach(), rtol=1e-6, atol=1e-6)


def test_grads_sum_over_train_steps_until_lazy_reset(mlp_adamw: Exported) -> None:
    session = _session(mlp_adamw.artifacts)
    binder = _binder(mlp_adamw.artifacts)
    reference = mlp_adamw.reference()
    (xa, ya), (xb, yb), (xc, yc) = blobs(8, seed=10), blobs(8, seed=11), blobs(8, seed=12)
    grads_a, grads_b = _torch_grads(reference, xa, ya), _torch_grads(reference, xb, yb)
    views = _views(session)
    addresses = {name: view.grad.data_ptr() for name, view in views.items() if view.grad is not None}

    session.train_step(binder((xa, ya)))
    session.train_step(binder((xa, ya)))
    for name, view in views.items():
        torch.testing.assert_close(view.grad, 2 * grads_a[name], rtol=0, atol=1e-5)

    session.lazy_reset_grad()
    session.train_step(binder((xa, ya)))
    session.train_step(binder((xb, yb)))
    summed = {name: grads_a[name] + grads_b[name] for name in grads_a}
    for name, view in views.items():
        torch.testing.assert_close(view.grad, summed[name], rtol=0, atol=1e-5)

    # The reset is lazy: the buffers keep the sum until the next train_step overwrites them.
    session.lazy_reset_grad()
    for name, view in views.items():
        torch.testing.assert_close(view.grad, summed[name], rtol=0, atol=1e-5)
    session.train_step(binder((xc, yc)))
    grads_c = _torch_grads(reference, xc, yc)
    for name, view in views.items():
        assert view.grad is not None
        assert view.grad.data_ptr() == addresses[name]
        torch.testing.assert_close(view.grad, grads_c[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("grad_scale", [1.0, 0.25], ids=["plain", "grads-scaled-in-place"])
@pytest.mark.parametrize("lr", [0.1, 0.5], ids=["lr0.1", "lr0.5"])
def test_sgd_step_is_w_minus_lr_g(mlp_sgd: Exported, lr: float, grad_scale: float) -> None:
    session = _session(mlp_sgd.artifacts)
    session.set_lr(lr)
    x, y = blobs(16, seed=13)
    views = _views(session)
    addresses = {name: view.data.data_ptr() for name, view in views.items()}

    reference = mlp_sgd.reference()
    grads = _torch_grads(reference, x, y)
    with torch.no_grad():
        expected = {name: p - lr * grad_scale * grads[name] for name, p in reference.named_parameters()}

    session.train_step(_binder(mlp_sgd.artifacts)((x, y)))
    if grad_scale != 1.0:
        # What the optimizer reads is the gradient buffer behind the view (clipping, averaging).
        torch._foreach_mul_([view.grad for view in views.values() if view.grad is not None], grad_scale)
    session.optimizer_step()

    for name, view in views.items():
        assert view.data.data_ptr() == addresses[name]
        torch.testing.assert_close(view.data, expected[name], rtol=0, atol=1e-6)
    fresh = _views(session)
    for name, view in fresh.items():
        assert view.data.data_ptr() == addresses[name]
    # The Module sees the Optimizer's update: both point at the one CheckpointState.
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.copy_(expected[name])
        expected_logits = reference(x)
    logits = to_torch(session.eval_step(_binder(mlp_sgd.artifacts, "eval")((x, y)))[1])
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)


def test_frozen_parameter_view_has_no_grad_and_stays_put(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = MLP()
    reference = copy.deepcopy(model)
    artifacts = export_artifacts(
        model, torch.zeros(2, 4), tmp_path, optimizer="sgd", frozen=["fc1.weight"], verify=False
    )
    session = _session(artifacts)
    session.set_lr(0.2)
    views = _views(session)
    assert {name for name, view in views.items() if not view.trainable} == {"fc1.weight"}
    assert views["fc1.weight"].grad is None
    x, y = blobs(16, seed=14)
    grads = _torch_grads(reference, x, y)

    session.train_step(_binder(artifacts)((x, y)))
    session.optimizer_step()

    for name, parameter in reference.named_parameters():
        expected = parameter.detach() if name == "fc1.weight" else parameter.detach() - 0.2 * grads[name]
        torch.testing.assert_close(views[name].data, expected, rtol=0, atol=1e-6)


def test_buffer_views_follow_batchnorm_running_statistics(bn_dropout_cnn: Exported) -> None:
    session = _session(bn_dropout_cnn.artifacts)
    views = _views(session)
    buffers = set(bn_dropout_cnn.artifacts.manifest.buffers)
    assert buffers == {"bn.running_mean", "bn.running_var"}
    for name in buffers:
        assert not views[name].trainable
        assert views[name].grad is None
    mean_before, var_before = views["bn.running_mean"].data.clone(), views["bn.running_var"].data.clone()
    address = views["bn.running_mean"].data.data_ptr()
    images = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(15))
    labels = torch.tensor([0, 1, 2, 3, 4, 5])

    session.train_step(_binder(bn_dropout_cnn.artifacts)((images, labels)))

    # torch's rule (momentum 0.1): running = 0.9 * running + 0.1 * batch statistic, with the
    # batch's unbiased variance (factor n / (n - 1), n = 6 * 8 * 8), as torch's BatchNorm2d keeps it.
    with torch.no_grad():
        features = bn_dropout_cnn.reference().conv(images)
    momentum = 0.1
    batch_mean = features.mean(dim=(0, 2, 3))
    expected_mean = (1 - momentum) * mean_before + momentum * batch_mean
    expected_var = (1 - momentum) * var_before + momentum * features.var(dim=(0, 2, 3), unbiased=True)
    assert views["bn.running_mean"].data.data_ptr() == address
    torch.testing.assert_close(views["bn.running_mean"].data, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(views["bn.running_var"].data, expected_var, rtol=1e-6, atol=1e-7)
    # The control: ORT's own kernel rule (the population variance) is measurably elsewhere.
    population_var = (1 - momentum) * var_before + momentum * features.var(dim=(0, 2, 3), unbiased=False)
    assert not torch.allclose(views["bn.running_var"].data, population_var, rtol=1e-5, atol=1e-6)
