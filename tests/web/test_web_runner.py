"""The device runner (``ort_lightning/web/runner.js``) trains in onnxruntime-web as ONNX Runtime's Python loop.

Node runs ``tests/web/train_device.mjs`` (the example of docs/browsers.md) on a device folder of the digits
MLP: the runner opens onnxruntime-web's training build on the graphs and the nominal checkpoint,
takes a server's weights, trains 2 epochs over 3 batches (int64 labels), evaluates and returns
the weights. The reference is ONNX Runtime's documented device loop in Python on a copy of the
same files: ``CheckpointState.load_checkpoint(nominal)``, ``Module``, ``copy_buffer_to_parameters``,
``Optimizer``, then ``train_step`` / ``optimizer.step()`` / ``lazy_reset_grad()``, and its eval
graph. onnxruntime-web cannot set a learning rate: a plain folder trains at ORT's default 1e-3 on
both sides; a folder from ``prepare_for_web`` trains in Node at the rate its optimizer graph
computes, and the reference is ORT's loop on the plain folder with ``set_learning_rate`` before
every step at the rate the schedule's formula gives (DESIGN, "The pipeline").
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from onnxruntime.training.api import CheckpointState
from sklearn.datasets import load_digits

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import digits_mlp
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import prepare_for_web
from ort_lightning.web import ENVIRONMENT_VARIABLE, TRAINING_BUILD, asset, find_ort_web
from tests._web import ROOT, NodeError, run_node
from tests.artifacts.generated import Case, generate_folder
from tests.helpers import RunIf, ort_device_start
from tests.web.runner_job import DRIVER, EPOCHS, node_run, write_job

#: ORT's default learning rate, the only one onnxruntime-web's optimizer runs at on an unprepared folder.
DEFAULT_LR = 1e-3
BATCH = 32

Batch = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Device:
    """A device folder (graphs + nominal checkpoint), its server's folder, the weights it sends, in parameter_order."""

    folder: Path
    server: Path
    order: tuple[str, ...]
    weights: np.ndarray


@pytest.fixture(scope="session")
def digits_device(tmp_path_factory: pytest.TempPathFactory) -> Device:
    root = tmp_path_factory.mktemp("web-runner")
    artifacts = export_artifacts(
        digits_mlp(), torch.zeros(2, 64), root / "server", verify=False, ort_format=True, nominal_checkpoint=True
    )
    device = shutil.copytree(artifacts.directory, root / "device", ignore=shutil.ignore_patterns("checkpoint"))
    order = TrainingArtifacts.load(artifacts.directory).manifest.parameter_order
    # The server's weights: the folder's initial values moved, so that a device cannot pass by ignoring them.
    generator = np.random.default_rng(7)
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    values = [np.array(state.parameters[name].data).ravel() for name in order]
    weights = np.concatenate([value + 0.05 * generator.standard_normal(value.size) for value in values])
    weights = weights.astype(np.float32)
    return Device(Path(device), artifacts.directory, tuple(order), weights)


def _digits_batches(count: int = 3) -> list[Batch]:
    features, labels = load_digits(return_X_y=True)
    rows = [slice(i * BATCH, (i + 1) * BATCH) for i in range(count)]
    return [((features[r] / 16.0).astype(np.float32), labels[r].astype(np.int64)) for r in rows]


@dataclass(frozen=True)
class Trained:
    losses: list[float]
    weights: np.ndarray
    eval_loss: float
    outputs: np.ndarray


def orts_python_loop(
    folder: Path, graphs: str, weights: np.ndarray, batches: list[Batch], *, rate: Callable[[int], float]
) -> Trained:
    """ONNX Runtime's documented device loop on `folder`: nominal checkpoint, the weights, E epochs, then eval.

    ``rate(s)`` is the learning rate of the optimizer step taken after `s` completed ones.
    """
    _, module, optimizer = ort_device_start(folder, graphs=graphs, values=weights)
    module.train()
    losses: list[float] = []
    for _ in range(EPOCHS):
        for batch in batches:
            losses.append(float(module(*batch)[0]))
            optimizer.set_learning_rate(rate(len(losses) - 1))
            optimizer.step()
            module.lazy_reset_grad()
    module.eval()
    evaluated = [module(*batch) for batch in batches]
    eval_loss = sum(float(loss) * len(batch[1]) for (loss, _), batch in zip(evaluated, batches, strict=True))
    return Trained(
        losses,
        module.get_contiguous_parameters(trainable_only=False).numpy().copy(),
        eval_loss / sum(len(batch[1]) for batch in batches),
        np.concatenate([logits.ravel() for _, logits in evaluated]),
    )


# ----------------------------------------------------------------------------- the folder's contract
def test_parameter_order_is_the_order_onnx_runtime_copies_the_buffer_in(digits_device: Device) -> None:
    # For this model (no buffers) the manifest's parameter_order is the training graph's order of its state
    # inputs, the order of ORT's buffer; tests/fleet/engines/browser/test_browser_data.py covers a model where they
    # differ.
    session = onnxruntime.InferenceSession(str(digits_device.folder / "training_model.onnx"))
    graph_order = [arg.name for arg in session.get_inputs() if arg.name in digits_device.order]
    assert tuple(graph_order) == digits_device.order == ("0.weight", "0.bias", "2.weight", "2.bias")


# ----------------------------------------------------------------------------- Node trains as ORT's Python loop
@pytest.mark.slow  # Node
@RunIf(node=True)
@pytest.mark.parametrize("graphs", ["ort", "onnx"], ids=["ort-graphs", "onnx-graphs"])
def test_node_runner_trains_and_evaluates_as_orts_python_loop(
    digits_device: Device, graphs: str, tmp_path: Path
) -> None:
    batches = _digits_batches()
    job = write_job(tmp_path / "node", digits_device.folder, graphs, digits_device.weights, batches)
    result, trained, outputs = node_run(job)

    reference_folder = shutil.copytree(digits_device.folder, tmp_path / "reference")  # the same files, read apart
    expected = orts_python_loop(reference_folder, graphs, digits_device.weights, batches, rate=lambda _: DEFAULT_LR)
    assert result["parameterCount"] == digits_device.weights.size == 64 * 64 + 64 + 64 * 10 + 10
    assert (result["steps"], result["examples"]) == (EPOCHS * len(batches), len(batches) * BATCH)
    np.testing.assert_allclose(result["losses"], expected.losses, rtol=1e-4, atol=0)
    assert float(np.abs(expected.weights - digits_device.weights).max()) > 1e-3, "the reference did not train"
    np.testing.assert_allclose(trained, expected.weights, rtol=0, atol=1e-5)
    evaluation = result["evaluation"]
    assert evaluation["examples"] == len(batches) * BATCH  # type: ignore[index]
    np.testing.assert_allclose(evaluation["loss"], expected.eval_loss, rtol=1e-4, atol=0)  # type: ignore[index]
    np.testing.assert_allclose(outputs, expected.outputs, rtol=0, atol=1e-5)


def _linear(lr: float, warmup: int, total: int) -> Callable[[int], float]:
    """DESIGN's linear schedule: ``s/max(1,W)`` below W, then ``max(0, (T-s)/max(1,T-W))``, times `lr`."""
    return lambda s: lr * (s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))


#: prepare_for_web's options, and the rate of each step by the formula (6 steps: 2 epochs of 3 batches).
SCHEDULES: dict[str, tuple[dict[str, object], Callable[[int], float]]] = {
    "constant-lr-0.01": ({"lr": 0.01}, lambda _: 0.01),
    "linear-lr-0.02-warmup-2-total-6": (
        {"lr": 0.02, "lr_scheduler": "linear", "warmup_steps": 2, "total_steps": 6}, _linear(0.02, 2, 6)
    ),
}


@pytest.mark.slow  # Node
@RunIf(node=True)
@pytest.mark.parametrize("schedule", list(SCHEDULES), ids=list(SCHEDULES))
def test_node_runner_trains_a_prepared_folder_at_its_schedule_as_orts_loop_sets_it(
    digits_device: Device, schedule: str, tmp_path: Path
) -> None:
    options, rate = SCHEDULES[schedule]
    prepared = prepare_for_web(digits_device.server, tmp_path / "web", **options)  # type: ignore[arg-type]
    shipped = shutil.copytree(prepared.directory, tmp_path / "device", ignore=shutil.ignore_patterns("checkpoint"))
    batches = _digits_batches()
    result, trained, _ = node_run(write_job(tmp_path / "node", Path(shipped), "ort", digits_device.weights, batches))

    plain = shutil.copytree(digits_device.folder, tmp_path / "reference")  # ORT sets the rate itself, step by step
    expected = orts_python_loop(plain, "ort", digits_device.weights, batches, rate=rate)
    at_default = orts_python_loop(plain, "ort", digits_device.weights, batches, rate=lambda _: DEFAULT_LR)
    assert float(np.abs(expected.weights - at_default.weights).max()) > 1e-3, "the schedule changes nothing"
    np.testing.assert_allclose(result["losses"], expected.losses, rtol=1e-4, atol=0)
    # NOTE: 1e-5 per 1e-3 of peak rate. AdamW moves a weight by about the rate whatever its gradient's size,
    # so where WebAssembly's and the native kernels' float sums differ in a tiny gradient, the weights differ
    # in proportion to the rate: measured 1.4e-6 at 1e-3 and 1.4e-5 at 1e-2, in the same single weight, while
    # ORT's Python loop on the prepared folder equals the plain folder with set_learning_rate bit for bit.
    atol = 1e-5 * max(rate(step) for step in range(len(expected.losses))) / DEFAULT_LR
    np.testing.assert_allclose(trained, expected.weights, rtol=0, atol=atol)
    np.testing.assert_allclose(result["evaluation"]["loss"], expected.eval_loss, rtol=1e-4, atol=0)  # type: ignore[index]


# ----------------------------------------------------------------------------- bad inputs, refused by name
@pytest.mark.slow  # Node
@RunIf(node=True)
def test_weights_of_the_wrong_length_are_refused_with_the_expected_count(digits_device: Device, tmp_path: Path) -> None:
    job = write_job(tmp_path, digits_device.folder, "ort", digits_device.weights[:-1], _digits_batches(1))
    message = (r"setWeights expects a Float32Array of 4810 values \(all parameters, flat, in the training graph's "
               r"order of its state inputs\), but got a Float32Array of 4809 values; send the weights of the artifacts")
    with pytest.raises(NodeError, match=message):
        run_node(DRIVER, str(job))


@pytest.mark.slow  # Node
@RunIf(node=True)
def test_a_batch_with_the_wrong_number_of_tensors_is_refused_with_the_inputs(
    digits_device: Device, tmp_path: Path
) -> None:
    features, labels = _digits_batches(2)[1]
    job = write_job(tmp_path, digits_device.folder, "ort", digits_device.weights, [_digits_batches(1)[0], (features,)])
    message = (r"batch 1 has 1 tensor\(s\), but the training graph takes 2 inputs \[input, labels\] \(model inputs, "
               r"then labels\); pass one tensor per input, in that order")
    with pytest.raises(NodeError, match=message):
        run_node(DRIVER, str(job))
    assert not (tmp_path / "trained.bin").exists()


@pytest.mark.slow  # Node
@RunIf(node=True)
def test_int32_labels_are_explained_where_onnxruntime_web_throws_a_bare_number(
    digits_device: Device, tmp_path: Path
) -> None:
    # NOTE: onnxruntime-web throws a WebAssembly exception's address, no message, for a tensor of another type.
    features, labels = _digits_batches(1)[0]
    batches = [(features, labels.astype(np.int32))]
    job = write_job(tmp_path, digits_device.folder, "ort", digits_device.weights, batches)
    message = (r"batch 0 of the training graph: onnxruntime-web failed without a message \(it threw the number \d+, "
               r"a WebAssembly exception\), which it does for a tensor whose type or shape the graph does not take; "
               r"check each tensor's type and dims against the inputs \[input, labels\] .* int64 labels go in as "
               r"\{type: 'int64', data: BigInt64Array\}")
    with pytest.raises(NodeError, match=message):
        run_node(DRIVER, str(job))


MISTAKES = {
    "inference-build": r"openDevice expects onnxruntime-web's training build, but the namespace it got has no training "
                       r"backend \(TrainingSession\.create: .*\); import dist/ort\.training\.wasm\.min\.mjs, not "
                       r"ort\.min\.mjs or ort\.wasm\.min\.mjs, of onnxruntime-web 1\.19\.2",
    "ort-left-out": r"openDevice expects onnxruntime-web's training build as its first argument \(a namespace with "
                    r"TrainingSession\), but got an Object; import dist/ort\.training\.wasm\.min\.mjs of "
                    r"onnxruntime-web 1\.19\.2",
    "paths-for-files": r"openDevice expects the files \{training: .*\} as Uint8Array each, but \[eval\] is missing or "
                       r"not a Uint8Array; read each file into a Uint8Array",
    "zero-epochs": r"train expects epochs to be a positive integer, but got the number 0; pass e\.g\. \{epochs: 1\}",
    "no-batches": r"expected a non-empty Array of batches for the training graph, but got an Array of 0 items; "
                  r"pass \[\[input, labels\], \.\.\.\]",
    "int64-as-numbers": r"batch 0, input 'labels': expected \{type, data, dims\} with type and data among \{float32: "
                        r"Float32Array, int64: BigInt64Array, .*\}, but got type 'int64' with an Array of 32 items as "
                        r"data; int64 labels go in as a BigInt64Array",
}


@pytest.mark.slow  # Node
@RunIf(node=True)
@pytest.mark.parametrize("mistake", list(MISTAKES), ids=list(MISTAKES))
def test_a_callers_mistake_is_refused_by_name(digits_device: Device, tmp_path: Path, mistake: str) -> None:
    job = write_job(tmp_path, digits_device.folder, "ort", digits_device.weights, _digits_batches(1))
    with pytest.raises(NodeError, match=MISTAKES[mistake]):
        run_node(ROOT / "tests" / "web" / "mistakes.mjs", str(job), mistake)


@pytest.mark.slow  # Node
@RunIf(node=True)
@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning")
def test_eval_outputs_of_a_generated_folder_without_model_outputs_are_refused(tmp_path: Path) -> None:
    # generate_artifacts without additional_output_names: the eval graph outputs the loss alone.
    folder = generate_folder(Case("loss-only-eval", {"nominal_checkpoint": True}), tmp_path / "generated")
    weights = np.concatenate([np.array(parameter.data).ravel() for _, parameter in
                              CheckpointState.load_checkpoint(str(folder / "checkpoint")).parameters])
    batch = (np.ones((4, 4), np.float32), np.arange(4, dtype=np.int64) % 3)
    job = write_job(tmp_path / "job", folder, "onnx", weights.astype(np.float32), [batch])
    message = (r"evaluate\(\{outputs: true\}\) needs an eval graph output besides the loss, but it has only \[[^]]+\]; "
               r"export the artifacts with the model's outputs kept, or pass \{outputs: false\}")
    with pytest.raises(NodeError, match=message):
        run_node(ROOT / "tests" / "web" / "mistakes.mjs", str(job), "outputs-of-a-loss-only-eval-graph")


# ----------------------------------------------------------------------------- the page's example is the driver
def test_readme_example_is_what_the_node_test_runs() -> None:
    page = (ROOT / "docs" / "browsers.md").read_text(encoding="utf-8")
    section = page.split("## The device runner", 1)[1]
    example = re.search(r"^```js\n(.*?)^```$", section, re.S | re.M)
    assert example is not None, "the device runner section of docs/browsers.md has no js block"
    assert example.group(1) in DRIVER.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- finding onnxruntime-web
def _dist(folder: Path) -> Path:
    dist = folder / "node_modules" / "onnxruntime-web" / "dist"
    dist.mkdir(parents=True)
    (dist / TRAINING_BUILD).write_text("// stands for the training build\n")
    return dist


def test_find_ort_web_takes_the_argument_then_the_environment_then_npms_folder_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    above, given, configured = _dist(tmp_path / "project"), _dist(tmp_path / "given"), _dist(tmp_path / "configured")
    work = tmp_path / "project" / "src" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, str(configured))
    assert find_ort_web(str(given)) == str(given)
    assert find_ort_web() == str(configured)
    monkeypatch.delenv(ENVIRONMENT_VARIABLE)
    assert find_ort_web() == str(above)
    assert find_ort_web("http://127.0.0.1:8000/ort/") == "http://127.0.0.1:8000/ort"


def test_find_ort_web_without_onnxruntime_web_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    message = (rf"Expected onnxruntime-web 1\.19\.2 for the device runner, but {ENVIRONMENT_VARIABLE} is not set and "
               r"there is no node_modules/onnxruntime-web/dist in .* or its parents; run npm install "
               r"onnxruntime-web@1\.19\.2")
    with pytest.raises(ConfigurationError, match=message):
        find_ort_web()


def test_find_ort_web_refuses_a_folder_without_the_training_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dist").mkdir()
    message = (rf"dist/ folder with its training build {re.escape(TRAINING_BUILD)}, but .*dist \(from dist=\) has no "
               r"such file; run npm install onnxruntime-web@1\.19\.2")
    with pytest.raises(ConfigurationError, match=message):
        find_ort_web(str(tmp_path / "dist"))
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, str(tmp_path))
    with pytest.raises(ConfigurationError, match=rf"\(from {ENVIRONMENT_VARIABLE}=\) has no such file"):
        find_ort_web()


def test_asset_names_the_shipped_files_when_asked_for_another() -> None:
    assert asset("runner.js").read_text(encoding="utf-8").count("export async function") == 2
    with pytest.raises(ConfigurationError, match=r"one of \[.*'runner\.js'.*\], but got 'runner\.mjs'; pass one of"):
        asset("runner.mjs")
