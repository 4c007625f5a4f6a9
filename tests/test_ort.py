"""Assembly of the ORT components, device strings and ORT's linear lr schedule, on real artifacts."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.errors import ArtifactError, CudaError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.session.parameters import parameter_views
from tests.conftest import Exported, blobs
from tests.helpers import RunIf


def _assemble(artifacts: TrainingArtifacts, device: str = "cpu", **paths: Path) -> _ort.TrainingSession:
    files = {
        "training_model": artifacts.training_model,
        "eval_model": artifacts.eval_model,
        "optimizer_model": artifacts.optimizer_model,
        "checkpoint": artifacts.checkpoint,
        **paths,
    }
    return _ort.assemble(**files, settings=_ort.SessionSettings(device=device))


def _binder(artifacts: TrainingArtifacts, device: str = "cpu") -> BatchBinder:
    return BatchBinder(artifacts.manifest.graph_inputs, torch.device(device), graph="training")


# --------------------------------------------------------------------------------------------- assembly
@pytest.mark.parametrize(
    ("fixture", "kind"), [("mlp_adamw", "adamw"), ("mlp_sgd", "sgd")], ids=["adamw", "sgd"]
)
def test_assemble_builds_state_module_and_optimizer(
    request: pytest.FixtureRequest, fixture: str, kind: str
) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    session = _assemble(exported.artifacts)

    assert session.device == "cpu"
    assert session.input_names() == ["input", "labels"]
    assert session.input_names(training=False) == ["input", "labels"]
    assert session.output_names() == [exported.artifacts.manifest.loss_output, "logits"]
    # The checkpoint state holds the torch model's parameters, under its names, with its values.
    reference = dict(exported.reference().named_parameters())
    parameters = {name: (data, grad, trainable) for name, data, grad, trainable in session.parameters()}
    assert sorted(parameters) == sorted(reference)
    for name, (data, grad, trainable) in parameters.items():
        assert trainable
        assert grad is not None
        torch.testing.assert_close(to_torch(data), reference[name].detach(), rtol=0, atol=0)
    # The kind comes from the optimizer graph itself, and agrees with what was exported.
    op_types = [node.op_type for node in onnx.load(exported.artifacts.optimizer_model).graph.node]
    assert _ort.optimizer_kind_of(op_types) == kind
    assert session.optimizer_kind == kind
    assert exported.artifacts.manifest.optimizer == kind


@pytest.mark.parametrize(
    ("op_types", "kind"),
    [
        (["AdamWOptimizer"], "adamw"),
        (["SGDOptimizerV2"], "sgd"),
        (["Identity", "SGDOptimizerV2"], "sgd"),
        (["Identity"], None),
        ([], None),
    ],
    ids=["adamw", "sgd", "sgd-after-other-nodes", "no-optimizer-node", "empty"],
)
def test_optimizer_kind_of_maps_node_types(op_types: list[str], kind: str | None) -> None:
    assert _ort.optimizer_kind_of(op_types) == kind


def test_assemble_refuses_optimizer_graph_without_optimizer_node(mlp_adamw: Exported, tmp_path: Path) -> None:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "not_an_optimizer",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    path = tmp_path / "optimizer_model.onnx"
    onnx.save(onnx.helper.make_model(graph), path)
    expected = r"has nodes \['Identity'\] but no AdamWOptimizer or SGDOptimizerV2 node; re-export"
    with pytest.raises(ArtifactError, match=expected):
        _assemble(mlp_adamw.artifacts, optimizer_model=path)


def test_parse_device_accepts_cpu() -> None:
    assert _ort.parse_device("cpu") == ("cpu", 0)


@pytest.mark.parametrize(
    "device", ["tpu", "cuda:x", "cpu:1", "cpu:0", "cuda:", "cpu:", "CPU", " cpu", "cuda:-1", "cuda:\u00b2"]
)
def test_misspelled_device_names_the_accepted_spellings(mlp_adamw: Exported, device: str) -> None:
    expected = rf"Expected a device 'cpu', 'cuda' or 'cuda:N', but got {re.escape(repr(device))}"
    with pytest.raises(CudaError, match=expected):
        _ort.parse_device(device)
    with pytest.raises(CudaError, match=expected):
        _assemble(mlp_adamw.artifacts, device)


@RunIf(cuda_build=False)
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_on_cpu_build_names_the_install_command(mlp_adamw: Exported, device: str) -> None:
    expected = (
        rf"Device {re.escape(repr(device))} needs the CUDA build of ONNX Runtime training.*"
        r"pip uninstall -y onnxruntime-training-cpu && pip install \"ort-lightning\[cuda\]\""
    )
    with pytest.raises(CudaError, match=expected):
        _assemble(mlp_adamw.artifacts, device)


@RunIf(cuda=True)
def test_cuda_session_moves_cpu_batches_to_the_gpu(mlp_adamw: Exported) -> None:
    session = _assemble(mlp_adamw.artifacts, "cuda")
    assert session.device == "cuda:0"
    x, y = blobs(16, seed=3)
    inputs = _binder(mlp_adamw.artifacts, session.device)((x, y))
    for i, tensor in enumerate((x, y)):
        bound = to_torch(inputs[i])
        assert bound.device == torch.device("cuda:0")
        torch.testing.assert_close(bound.cpu(), tensor, rtol=0, atol=0)

    loss = to_torch(session.train_step(inputs)[0])
    reference = mlp_adamw.reference()
    expected = F.cross_entropy(reference(x), y)
    expected.backward()
    assert loss.device == torch.device("cuda:0")
    torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(reference.named_parameters())
    for view in parameter_views(session):
        assert view.data.device == torch.device("cuda:0")
        assert view.grad is not None
        torch.testing.assert_close(view.grad.cpu(), grads[view.name].grad, rtol=1e-4, atol=1e-5)

    # A batch that torch is still producing on the GPU (pinned, non_blocking copy, then a kernel)
    # is complete by the time ORT reads it.
    doubled = x.pin_memory().to("cuda:0", non_blocking=True) * 2
    loss = to_torch(session.eval_step(_binder(mlp_adamw.artifacts, session.device)((doubled, y.cuda())))[0])
    with torch.no_grad():
        expected = F.cross_entropy(mlp_adamw.reference()(x * 2), y)
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-5, atol=1e-6)


def test_outputs_of_a_step_survive_the_next_step(mlp_sgd: Exported) -> None:
    session = _assemble(mlp_sgd.artifacts)
    binder = _binder(mlp_sgd.artifacts)
    x, y = blobs(8, seed=4)
    first = to_torch(session.train_step(binder((x, y)))[1])
    kept = first.clone()
    session.train_step(binder((x * 2, y)))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ linear lr schedule
def _warmup_then_decay(step: int, *, warmup: int, total: int, peak: float) -> float:
    """Closed form: straight line 0 -> peak over `warmup` steps, then peak -> 0 at `total`, then 0."""
    if warmup == 0:
        return float(np.interp(step, [0, total], [peak, 0.0]))
    return float(np.interp(step, [0, warmup, total], [0.0, peak, 0.0]))


def _run_steps(
    session: _ort.TrainingSession, binder: BatchBinder, scheduler_step: Callable[[], None], steps: int
) -> list[float]:
    """Train `steps` SGD steps; return the lr before each, checked against the parameter update it made."""
    x, y = blobs(16, seed=5)
    inputs = binder((x, y))
    lrs = []
    for _ in range(steps):
        lr = session.get_lr()
        session.train_step(inputs)
        views = [view for view in parameter_views(session) if view.grad is not None]
        before = [(view.data.clone(), view.grad.clone()) for view in views]
        session.optimizer_step()
        after = [view.data for view in views]
        # The lr reported is the lr applied: SGD moved every parameter by -lr * grad.
        for (data, grad), new in zip(before, after, strict=True):
            torch.testing.assert_close(new, data - lr * grad, rtol=1e-5, atol=1e-7)
        session.lazy_reset_grad()
        scheduler_step()
        lrs.append(lr)
    return lrs


def test_ort_python_linear_scheduler_still_swaps_warmup_and_total(mlp_sgd: Exported) -> None:
    """ORT 1.19.2's own wrapper, asked for W=2, T=10, ramps for 10 steps: why the documented device call passes (T, W).

    If this fails after an ONNX Runtime upgrade, the wrapper was fixed; re-check ``DOCUMENTED_DEVICE_CALL``.
    """
    from onnxruntime.training.api import LinearLRScheduler

    peak = 0.1
    session = _assemble(mlp_sgd.artifacts)
    session.set_lr(peak)
    scheduler = LinearLRScheduler(
        session.ort_objects[2], warmup_step_count=2, total_step_count=10, initial_lr=peak
    )

    lrs = _run_steps(session, _binder(mlp_sgd.artifacts), scheduler.step, 12)

    ramp_for_ten_steps = [peak * step / 10 if step < 10 else 0.0 for step in range(12)]
    assert lrs == pytest.approx(ramp_for_ten_steps, rel=1e-6, abs=1e-9)
    asked_for = [_warmup_then_decay(step, warmup=2, total=10, peak=peak) for step in range(12)]
    assert lrs != pytest.approx(asked_for)


#: The call docs/guide/training.md tells a Python device script to write for the product's linear schedule.
DOCUMENTED_DEVICE_CALL = "LinearLRScheduler(optimizer, T, W, lr)"


def _product_schedule(step: int, *, warmup: int, total: int) -> float:
    """DESIGN's formula: ``s/max(1,W)`` during the warmup, then ``max(0, (T-s)/max(1,T-W))``."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@pytest.mark.parametrize(("warmup", "total"), [(3, 8), (2, 10), (0, 6)], ids=["W3-T8", "W2-T10", "W0-T6"])
def test_documented_device_call_of_orts_python_scheduler_gives_the_product_schedule(
    mlp_sgd: Exported, warmup: int, total: int
) -> None:
    """ORT's own Python API, as a device script uses it, with the counts passed as docs/guide/training.md says."""
    from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    page = Path(__file__).parents[1] / "docs" / "guide" / "training.md"
    assert DOCUMENTED_DEVICE_CALL in " ".join(page.read_text().split())
    artifacts, lr = mlp_sgd.artifacts, 0.2
    module = Module(str(artifacts.training_model), CheckpointState.load_checkpoint(str(artifacts.checkpoint)),
                    str(artifacts.eval_model))
    optimizer = Optimizer(str(artifacts.optimizer_model), module)
    scheduler = LinearLRScheduler(optimizer, total, warmup, lr)  # DOCUMENTED_DEVICE_CALL with T=total, W=warmup
    x, y = blobs(8, seed=2)
    module.train()
    lrs = []
    for _ in range(total + 2):
        lrs.append(optimizer.get_learning_rate())
        module(x.numpy(), y.numpy())
        optimizer.step()
        scheduler.step()
        module.lazy_reset_grad()
    expected = [lr * _product_schedule(step, warmup=warmup, total=total) for step in range(total + 2)]
    assert lrs == pytest.approx(expected, rel=1e-6, abs=1e-9)
