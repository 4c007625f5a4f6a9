"""export_artifacts on tiny torch and ONNX models, checked with onnxruntime.training.api against torch.

The exports skip verification (``verify=False``; tests/export/test_verify.py tests it), except where the
verification's own torch reference is what a test watches (the model left untouched).
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnxruntime.training.api import CheckpointState, Module, Optimizer

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.errors import ExportError
from tests.conftest import MLP, Exported, SummedMSE

GRAPHS = ("training_model", "eval_model", "optimizer_model")
FILES = (*GRAPHS, "checkpoint")


class ORT:
    """A fresh CheckpointState, Module and Optimizer over a set of artifacts (the public ORT API)."""

    def __init__(self, artifacts: TrainingArtifacts) -> None:
        self.state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
        self.module = Module(str(artifacts.training_model), self.state, str(artifacts.eval_model))
        self.optimizer = Optimizer(str(artifacts.optimizer_model), self.module)

    def train(self, *batch: torch.Tensor) -> list[np.ndarray]:
        self.module.train()
        return self._run(batch)

    def eval(self, *batch: torch.Tensor) -> list[np.ndarray]:
        self.module.eval()
        return self._run(batch)

    def _run(self, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        outputs = self.module(*[tensor.numpy() for tensor in batch])
        # Module returns a bare array when the graph has a single output.
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]

    def step(self, *batch: torch.Tensor) -> float:
        """Forward, backward and one optimizer update; return the training loss."""
        loss = self.train(*batch)[0]
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return float(loss)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every tensor of the state: trainable, frozen and buffers."""
        return {name: np.array(parameter.data) for name, parameter in self.state.parameters}

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy ORT's parameters and buffers into `model` (the torch reference)."""
        values = self.parameters()
        state = model.state_dict()
        for name in values:
            state[name] = torch.from_numpy(values[name])
        model.load_state_dict(state)
        return model


def _onnx_export(model: torch.nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """What a user does by hand: the TorchScript exporter, eval mode, dynamic batch."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            buffer,
            dynamo=False,
            input_names=["x"],
            output_names=["out"],
            dynamic_axes={"x": {0: "n"}, "out": {0: "n"}},
        )
    return onnx.load_from_string(buffer.getvalue())


def _batch(n: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _ai_onnx_opset(proto: onnx.ModelProto) -> int:
    return max(opset.version for opset in proto.opset_import if opset.domain in ("", "ai.onnx"))


class BNOnly(torch.nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, no Dropout: the training graph is deterministic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


class ReturnsLoss(torch.nn.Module):
    """forward(x, target) -> its own loss (and the logits too if asked), for loss=None."""

    def __init__(self, loss: str, *, with_logits: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.loss = F.cross_entropy if loss == "cross_entropy" else F.mse_loss
        self.with_logits = with_logits

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> Any:
        logits = self.fc(x)
        loss = self.loss(logits, target)
        return (loss, logits) if self.with_logits else loss


# --- sources: torch module, ONNX file, ModelProto -------------------------------------------


@pytest.fixture(scope="module")
def source_mlp() -> MLP:
    torch.manual_seed(3)
    return MLP()


@pytest.fixture(scope="module", params=["torch", "onnx_file", "model_proto"])
def exported_from(
    request: pytest.FixtureRequest, source_mlp: MLP, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, TrainingArtifacts]:
    folder = tmp_path_factory.mktemp(f"from_{request.param}")
    if request.param == "torch":
        return request.param, export_artifacts(
            copy.deepcopy(source_mlp), torch.zeros(2, 4), folder / "artifacts", verify=False
        )
    proto = _onnx_export(copy.deepcopy(source_mlp), torch.zeros(2, 4))
    if request.param == "model_proto":
        return request.param, export_artifacts(proto, output_dir=folder / "artifacts", verify=False)
    onnx.save(proto, folder / "model.onnx")
    return request.param, export_artifacts(str(folder / "model.onnx"), output_dir=folder / "artifacts", verify=False)


def test_export_writes_four_files_and_manifest(exported_from: tuple[str, TrainingArtifacts]) -> None:
    _, artifacts = exported_from
    names = sorted(path.name for path in artifacts.directory.iterdir())
    assert names == sorted(
        ["checkpoint", "eval_model.onnx", "optimizer_model.onnx", "ort_lightning.json", "training_model.onnx"]
    )
    assert all(getattr(artifacts, name).stat().st_size > 0 for name in FILES)


def test_export_manifest_describes_graphs(exported_from: tuple[str, TrainingArtifacts]) -> None:
    source, artifacts = exported_from
    manifest = artifacts.manifest
    # The torch exporter names things itself; a hand-exported ONNX model keeps its own names.
    x, batch, out = ("input", "batch", "logits") if source == "torch" else ("x", "n", "out")
    assert [(s.name, s.dtype, s.shape) for s in manifest.inputs] == [(x, "float32", (batch, 4))]
    assert [(s.name, s.dtype, s.shape) for s in manifest.labels] == [("labels", "int64", (batch,))]
    assert manifest.outputs == (out,)
    assert manifest.loss == "cross_entropy"
    assert manifest.optimizer == "adamw"
    assert manifest.optimizer_options == {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert manifest.trainable == ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")
    assert manifest.frozen == ()
    assert manifest.buffers == ()
    training = onnx.load(artifacts.training_model)
    assert training.graph.output[0].name == manifest.loss_output
    assert [i.name for i in training.graph.input][:2] == [x, "labels"]


def test_export_keeps_source_weights(exported_from: tuple[str, TrainingArtifacts], source_mlp: MLP) -> None:
    _, artifacts = exported_from
    x, y = _batch()
    ort = ORT(artifacts)
    for name, tensor in source_mlp.state_dict().items():
        np.testing.assert_array_equal(ort.parameters()[name], tensor.numpy(), err_msg=name)
    loss, logits = ort.eval(x, y)
    with torch.no_grad():
        expected = source_mlp(x)
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-6)
    assert float(loss) == pytest.approx(F.cross_entropy(expected, y).item(), abs=1e-5)


def test_export_from_onnx_file_that_is_missing_or_not_onnx(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"ONNX file .*missing\.onnx does not exist"):
        export_artifacts(str(tmp_path / "missing.onnx"), output_dir=tmp_path / "out")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not an onnx model\xff" * 10)
    with pytest.raises(ExportError, match=r"garbage\.onnx is not a readable ONNX model"):
        export_artifacts(str(garbage), output_dir=tmp_path / "out")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"model": object()},
            r"Expected `model` to be a torch.nn.Module, an onnx.ModelProto .* but got object",
        ),
        ({"example_inputs": [1, 2]}, r"Expected `example_inputs` to be a tensor or a tuple of tensors"),
        (
            {"loss": "hinge"},
            r"Expected `loss` to be one of \['cross_entropy', 'mse', 'bce_with_logits', 'l1', 'nll', 'smooth_l1', "
            r"'huber'\]",
        ),
    ],
    ids=["model-type", "example-inputs", "unknown-loss"],
)
def test_export_refuses_bad_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"model": MLP(), "example_inputs": torch.zeros(2, 4), **kwargs}
    with pytest.raises(ExportError, match=match):
        export_artifacts(arguments.pop("model"), arguments.pop("example_inputs"), tmp_path, **arguments)


# --- losses ---------------------------------------------------------------------------------

_LOSSES: dict[str, tuple[Callable[..., torch.Tensor], Callable[[torch.Generator], torch.Tensor]]] = {
    # loss name -> (torch reference, labels for a batch of 5 with 3 outputs)
    "cross_entropy": (F.cross_entropy, lambda g: torch.randint(0, 3, (5,), generator=g)),
    "mse": (F.mse_loss, lambda g: torch.randn(5, 3, generator=g)),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, lambda g: torch.rand(5, 3, generator=g)),
    "l1": (F.l1_loss, lambda g: torch.randn(5, 3, generator=g)),
    "custom": (
        lambda out, target: F.mse_loss(out, target, reduction="sum"),
        lambda g: torch.randn(5, 3, generator=g),
    ),
}


@pytest.fixture(scope="module", params=list(_LOSSES))
def loss_export(
    request: pytest.FixtureRequest, source_mlp: MLP, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, TrainingArtifacts]:
    loss = SummedMSE() if request.param == "custom" else request.param
    folder = tmp_path_factory.mktemp(f"loss_{request.param}")
    return request.param, export_artifacts(
        copy.deepcopy(source_mlp), torch.zeros(2, 4), folder, loss=loss, verify=False
    )


def test_loss_equals_torch_loss(loss_export: tuple[str, TrainingArtifacts], source_mlp: MLP) -> None:
    name, artifacts = loss_export
    reference, make_labels = _LOSSES[name]
    generator = torch.Generator().manual_seed(4)
    x, labels = torch.randn(5, 4, generator=generator), make_labels(generator)
    with torch.no_grad():
        logits = source_mlp(x)
        expected = reference(logits, labels).item()
    ort = ORT(artifacts)
    for graph, run in (("eval", ort.eval), ("training", ort.train)):
        loss, ort_logits = run(x, labels)
        assert float(loss) == pytest.approx(expected, abs=1e-5), graph
        np.testing.assert_allclose(ort_logits, logits.numpy(), atol=1e-6, err_msg=graph)


def test_loss_manifest(loss_export: tuple[str, TrainingArtifacts]) -> None:
    name, artifacts = loss_export
    manifest = artifacts.manifest
    label = (
        ("labels", "int64", ("batch",)) if name == "cross_entropy" else ("target", "float32", ("batch", 3))
    )
    assert manifest.loss == name
    assert [(s.name, s.dtype, s.shape) for s in manifest.labels] == [label]
    assert manifest.outputs == ("logits",)


@pytest.mark.parametrize("with_logits", [False, True], ids=["loss", "loss-and-logits"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"], ids=str)
def test_model_returning_its_loss(tmp_path: Path, loss: str, with_logits: bool) -> None:
    torch.manual_seed(5)
    model = ReturnsLoss(loss, with_logits=with_logits)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(6, 4, generator=generator)
    if loss == "cross_entropy":
        target = torch.randint(0, 3, (6,), generator=generator)
    else:
        target = torch.randn(6, 3, generator=generator)
    artifacts = export_artifacts(copy.deepcopy(model), (x[:2], target[:2]), tmp_path, loss=None, verify=False)
    manifest = artifacts.manifest
    assert manifest.loss == "model"
    assert [(s.name, s.dtype) for s in manifest.inputs] == [
        ("input_0", "float32"),
        ("input_1", str(target.dtype)[6:]),
    ]
    assert manifest.labels == ()
    assert manifest.outputs == (("output_1",) if with_logits else ())
    assert manifest.loss_output == "loss"
    ort = ORT(artifacts)
    for graph in (True, False):
        ort.module.train(graph)
        assert ort.module.output_names() == ["loss", *manifest.outputs]
    # The model's own loss trains like torch.optim.AdamW trains the model.
    ort.optimizer.set_learning_rate(0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        outputs = model(x, target)
        expected = outputs[0] if with_logits else outputs
        expected.backward()
        optimizer.step()
        assert ort.step(x, target) == pytest.approx(expected.item(), abs=1e-5)
    for name, parameter in model.named_parameters():
        np.testing.assert_allclose(
            ort.parameters()[name], parameter.detach().numpy(), atol=1e-5, err_msg=name
        )


# --- optimizers -----------------------------------------------------------------------------


def _optimizer_nodes(artifacts: TrainingArtifacts) -> dict[str, dict[str, Any]]:
    proto = onnx.load(artifacts.optimizer_model)
    return {
        node.op_type: {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for node in proto.graph.node
    }


def test_adamw_defaults_are_torch_adamw_defaults(mlp_adamw: Exported) -> None:
    torch_defaults = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    attributes = _optimizer_nodes(mlp_adamw.artifacts)["AdamWOptimizer"]
    # The graph stores float32: compare at float32 precision.
    assert attributes["alpha"] == pytest.approx(torch_defaults["betas"][0], rel=1e-7)
    assert attributes["beta"] == pytest.approx(torch_defaults["betas"][1], rel=1e-7)
    assert attributes["epsilon"] == pytest.approx(torch_defaults["eps"], rel=1e-7)
    assert attributes["weight_decay"] == pytest.approx(torch_defaults["weight_decay"], rel=1e-7)
    # adam_mode 0: decay before the update, as torch.optim.AdamW; torch always corrects bias.
    assert attributes["adam_mode"] == 0
    assert attributes["correct_bias"] == 1


def test_adamw_options_override_defaults(tmp_path: Path) -> None:
    options = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}
    artifacts = export_artifacts(MLP(), torch.zeros(2, 4), tmp_path, optimizer_options=options, verify=False)
    attributes = _optimizer_nodes(artifacts)["AdamWOptimizer"]
    assert (attributes["alpha"], attributes["beta"]) == (pytest.approx(0.8), pytest.approx(0.99))
    assert attributes["epsilon"] == pytest.approx(1e-6)
    assert attributes["weight_decay"] == pytest.approx(0.1)
    assert attributes["adam_mode"] == 0
    assert artifacts.manifest.optimizer_options == {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1}


def test_sgd_writes_sgd_graph(mlp_sgd: Exported) -> None:
    assert set(_optimizer_nodes(mlp_sgd.artifacts)) == {"SGDOptimizerV2"}
    assert mlp_sgd.artifacts.manifest.optimizer == "sgd"
    assert mlp_sgd.artifacts.manifest.optimizer_options == {}


@pytest.mark.parametrize(
    ("fixture", "make_optimizer"),
    [
        ("mlp_adamw", lambda params, lr: torch.optim.AdamW(params, lr=lr)),
        ("mlp_sgd", lambda params, lr: torch.optim.SGD(params, lr=lr)),
    ],
    ids=["adamw", "sgd"],
)
def test_optimizer_steps_match_torch(
    request: pytest.FixtureRequest, fixture: str, make_optimizer: Any
) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    ort, reference = ORT(exported.artifacts), exported.reference()
    ort.optimizer.set_learning_rate(0.05)
    optimizer = make_optimizer(reference.parameters(), 0.05)
    for seed in range(10):
        x, y = _batch(6, seed)
        ort.step(x, y)
        optimizer.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimizer.step()
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(
            ort.parameters()[name], parameter.detach().numpy(), atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize(
    ("optimizer", "options", "match"),
    [
        ("adam", None, r"Expected `optimizer` to be one of \['adamw', 'sgd'\], but got 'adam'"),
        (
            "adamw",
            {"momentum": 0.9},
            r"Unknown optimizer_options \['momentum'\] for 'adamw'; it accepts \['betas'",
        ),
        (
            "sgd",
            {"weight_decay": 0.1},
            r"Unknown optimizer_options \['weight_decay'\] for 'sgd'.*use optimizer='adamw'",
        ),
    ],
    ids=["unknown-optimizer", "unknown-adamw-option", "sgd-weight-decay"],
)
def test_optimizer_errors(tmp_path: Path, optimizer: str, options: dict[str, Any] | None, match: str) -> None:
    with pytest.raises(ExportError, match=match):
        export_artifacts(MLP(), torch.zeros(2, 4), tmp_path, optimizer=optimizer, optimizer_options=options)
    assert not (tmp_path / "training_model.onnx").exists()


# --- frozen parameters ----------------------------------------------------------------------

_FROZEN = ["fc1.bias", "fc1.weight"]


@pytest.fixture(scope="module")
def frozen_mlp(source_mlp: MLP, tmp_path_factory: pytest.TempPathFactory) -> TrainingArtifacts:
    return export_artifacts(
        copy.deepcopy(source_mlp), torch.zeros(2, 4), tmp_path_factory.mktemp("frozen"), frozen=_FROZEN, verify=False
    )


def test_frozen_parameters_are_not_trainable(frozen_mlp: TrainingArtifacts) -> None:
    assert frozen_mlp.manifest.frozen == tuple(_FROZEN)
    assert frozen_mlp.manifest.trainable == ("fc2.bias", "fc2.weight")
    state = CheckpointState.load_checkpoint(str(frozen_mlp.checkpoint))
    assert {name: parameter.requires_grad for name, parameter in state.parameters} == {
        "fc1.bias": False,
        "fc1.weight": False,
        "fc2.bias": True,
        "fc2.weight": True,
    }


def test_frozen_parameters_stay_unchanged_while_training(
    frozen_mlp: TrainingArtifacts, source_mlp: MLP
) -> None:
    ort = ORT(frozen_mlp)
    ort.optimizer.set_learning_rate(0.1)
    for seed in range(3):
        ort.step(*_batch(6, seed))
    after = ort.parameters()
    for name, tensor in source_mlp.state_dict().items():
        if name in _FROZEN:
            np.testing.assert_array_equal(after[name], tensor.numpy(), err_msg=name)
        else:
            assert not np.allclose(after[name], tensor.numpy()), f"{name} did not train"


@pytest.mark.parametrize("source", ["torch", "model_proto"], ids=str)
def test_frozen_unknown_name_is_refused(tmp_path: Path, source_mlp: MLP, source: str) -> None:
    model: Any = source_mlp if source == "torch" else _onnx_export(source_mlp, torch.zeros(2, 4))
    with pytest.raises(
        ExportError, match=r"Cannot freeze \['fc3.weight'\]: not parameters of the model.*'fc1.bias'"
    ):
        export_artifacts(model, torch.zeros(2, 4), tmp_path, frozen=["fc1.weight", "fc3.weight"])


def test_freezing_everything_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="No parameter is left to train"):
        export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tmp_path, frozen=["weight", "bias"])


# --- dynamic batch, model outputs -----------------------------------------------------------


@pytest.mark.parametrize("batch", [3, 7], ids=lambda n: f"batch{n}")
def test_training_graph_takes_any_batch_size(mlp_adamw: Exported, batch: int) -> None:
    x, y = _batch(batch, seed=batch)
    with torch.no_grad():
        logits = mlp_adamw.reference()(x)
    ort = ORT(mlp_adamw.artifacts)
    loss, ort_logits = ort.train(x, y)
    assert ort_logits.shape == (batch, 3)
    np.testing.assert_allclose(ort_logits, logits.numpy(), atol=1e-6)
    assert float(loss) == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-5)


def test_model_outputs_are_graph_outputs(mlp_adamw: Exported) -> None:
    module = ORT(mlp_adamw.artifacts).module
    loss_output = mlp_adamw.artifacts.manifest.loss_output
    assert module.output_names() == [loss_output, "logits"]
    module.eval()
    assert module.output_names() == [loss_output, "logits"]


# --- BatchNorm and Dropout ------------------------------------------------------------------


def _images(n: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ten classes, each a bright pixel at its own place on an 8x8 image: separable."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    x = 0.1 * torch.randn(n, 1, 8, 8, generator=generator)
    x.view(n, 64)[torch.arange(n), labels * 6] += 3.0
    return x, labels


def test_bn_dropout_eval_graph_loads_and_is_deterministic(bn_dropout_cnn: Exported) -> None:
    ort = ORT(bn_dropout_cnn.artifacts)
    x, y = _images(8)
    first, second = ort.eval(x, y)[1], ort.eval(x, y)[1]
    np.testing.assert_array_equal(first, second)


def test_bn_dropout_training_graph_drops_out(bn_dropout_cnn: Exported) -> None:
    ort = ORT(bn_dropout_cnn.artifacts)
    x, y = _images(8)
    first, second = ort.train(x, y)[1], ort.train(x, y)[1]
    assert np.abs(first - second).max() > 1e-3


def test_bn_dropout_eval_graph_equals_torch_eval(bn_dropout_cnn: Exported) -> None:
    ort = ORT(bn_dropout_cnn.artifacts)
    ort.optimizer.set_learning_rate(0.01)
    for seed in range(3):  # move parameters and running statistics away from their start
        ort.step(*_images(20, seed))
    reference = ort.load_into(bn_dropout_cnn.reference()).eval()
    x, y = _images(8, seed=10)
    loss, logits = ort.eval(x, y)
    with torch.no_grad():
        expected = reference(x)
    np.testing.assert_allclose(logits, expected.numpy(), atol=1e-5)
    assert float(loss) == pytest.approx(F.cross_entropy(expected, y).item(), abs=1e-5)


def test_bn_dropout_training_loss_falls(bn_dropout_cnn: Exported) -> None:
    ort = ORT(bn_dropout_cnn.artifacts)
    ort.optimizer.set_learning_rate(0.01)
    x, y = _images(20)
    losses = [ort.step(x, y) for _ in range(30)]
    assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:3])
    assert float(ort.eval(x, y)[0]) < 0.2


@pytest.fixture(scope="module")
def bn_only(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    torch.manual_seed(6)
    model = BNOnly()
    return Exported(
        export_artifacts(copy.deepcopy(model), torch.zeros(2, 4), tmp_path_factory.mktemp("bn"), verify=False), model
    )


def test_batchnorm_statistics_are_buffers(bn_only: Exported) -> None:
    manifest = bn_only.artifacts.manifest
    assert manifest.buffers == ("bn.running_mean", "bn.running_var")
    assert set(manifest.trainable) == {name for name, _ in bn_only.model.named_parameters()}
    state = CheckpointState.load_checkpoint(str(bn_only.artifacts.checkpoint))
    assert not state.parameters["bn.running_mean"].requires_grad
    assert not state.parameters["bn.running_var"].requires_grad


def test_batchnorm_checkpoint_starts_from_model_statistics(tmp_path: Path) -> None:
    model = BNOnly()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.arange(6.0))
        model.bn.running_var.fill_(2.0)
    # The exporter traces one training-mode forward; that must not leak into the checkpoint.
    artifacts = export_artifacts(model, torch.randn(4, 4), tmp_path, verify=False)
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    np.testing.assert_array_equal(state.parameters["bn.running_mean"].data, np.arange(6.0, dtype=np.float32))
    np.testing.assert_array_equal(state.parameters["bn.running_var"].data, np.full(6, 2.0, dtype=np.float32))


def test_batchnorm_training_graph_matches_torch_train_mode(bn_only: Exported) -> None:
    ort, reference = ORT(bn_only.artifacts), bn_only.reference().train()
    for seed in range(3):
        x, y = _batch(5, seed)
        loss, logits = ort.train(x, y)
        with torch.no_grad():
            expected = reference(x)
        np.testing.assert_allclose(logits, expected.numpy(), atol=1e-5)
        assert float(loss) == pytest.approx(F.cross_entropy(expected, y).item(), abs=1e-5)
    # momentum 0.1 (torch) is ONNX momentum 0.9: running = 0.9 * running + 0.1 * batch mean.
    assert reference.bn.momentum == pytest.approx(0.1)
    np.testing.assert_allclose(
        ort.parameters()["bn.running_mean"], reference.bn.running_mean.numpy(), atol=1e-6
    )


def test_batchnorm_running_var_uses_unbiased_batch_variance(bn_only: Exported) -> None:
    # NOTE: ORT's kernel follows the ONNX spec (population variance); the training graph is
    # rewritten to torch's rule: 0.9 * running + 0.1 * var * n / (n - 1).
    ort = ORT(bn_only.artifacts)
    start = ort.parameters()["bn.running_var"]
    x, y = _batch(5, seed=0)
    ort.train(x, y)
    reference = bn_only.reference()
    with torch.no_grad():
        hidden = reference.fc(x)
    expected = 0.9 * start + 0.1 * hidden.var(dim=0, unbiased=True).numpy()
    np.testing.assert_allclose(ort.parameters()["bn.running_var"], expected, rtol=1e-6, atol=1e-7)


# --- IR version and opset -------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["mlp_adamw", "mlp_sgd", "bn_dropout_cnn"], ids=str)
def test_graphs_are_ir10_opset21_at_most(request: pytest.FixtureRequest, fixture: str) -> None:
    artifacts: TrainingArtifacts = request.getfixturevalue(fixture).artifacts
    for graph in GRAPHS:
        proto = onnx.load(getattr(artifacts, graph))
        assert proto.ir_version <= 10, graph
        assert _ai_onnx_opset(proto) <= 21, graph


def test_ir11_source_gives_ir10_artifacts(tmp_path: Path, source_mlp: MLP) -> None:
    proto = _onnx_export(source_mlp, torch.zeros(2, 4))
    proto.ir_version = 11  # what onnx >= 1.18 stamps on everything it writes
    artifacts = export_artifacts(proto, output_dir=tmp_path, verify=False)
    assert proto.ir_version == 11, "the caller's ModelProto must not change"
    for graph in GRAPHS:
        assert onnx.load(getattr(artifacts, graph)).ir_version <= 10, graph
    x, y = _batch()
    loss = ORT(artifacts).step(x, y)
    with torch.no_grad():
        assert loss == pytest.approx(F.cross_entropy(source_mlp(x), y).item(), abs=1e-5)


def test_opset22_source_is_refused(tmp_path: Path, source_mlp: MLP) -> None:
    proto = _onnx_export(source_mlp, torch.zeros(2, 4))
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 22
    with pytest.raises(
        ExportError, match=r"ONNX model \(graph 'main_graph'\) uses ai.onnx opset 22.*opset <= 21"
    ):
        export_artifacts(proto, output_dir=tmp_path)
    assert not (tmp_path / "training_model.onnx").exists()


# --- the caller's model ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["train", "eval"], ids=str)
def test_export_leaves_the_torch_model_untouched(tmp_path: Path, mode: str) -> None:
    torch.manual_seed(7)
    model = BNOnly()
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.linspace(-1, 1, 6))
        model.bn.running_var.fill_(3.0)
    model.train(mode == "train")
    before = copy.deepcopy(model.state_dict())
    export_artifacts(model, torch.randn(4, 4), tmp_path)
    assert model.training == (mode == "train")
    after = model.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=name)
    assert all(parameter.requires_grad for parameter in model.parameters())


def test_torch_parameters_without_grad_are_frozen_like_in_torch(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    model[0].weight.requires_grad_(False)
    artifacts = export_artifacts(model, torch.zeros(2, 4), tmp_path / "art", frozen=["0.bias"], verify=False)
    assert artifacts.manifest.frozen == ("0.bias", "0.weight")
    assert artifacts.manifest.trainable == ("2.bias", "2.weight")
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    assert not state.parameters["0.weight"].requires_grad
    assert state.parameters["2.weight"].requires_grad
