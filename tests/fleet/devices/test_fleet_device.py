"""A simulated device runs what a real device runs: ONNX Runtime's loop on the device folder.

Every reference here is independent of ``ort_lightning.fleet``: ONNX Runtime's documented Python
loop (``tests.helpers.ort_device_loop``) on the same files, fed the batches that torch's own
``DataLoader`` iterates, averaged by FedAvg in float64; and onnxruntime-web's runner in Node.
"""

from __future__ import annotations

import json
import re
import resource
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import FEATURES, digits_mlp
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import prepare_for_web
from tests.helpers import RunIf, ort_device_loop, ort_device_start

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    ClientData,
    DeviceClient,
    FleetServer,
    GlobalModel,
    LocalGrid,
    round_path,
    run_local,
)
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader  # noqa: E402
from ort_lightning.fleet.run import FleetConfig, run_experiment  # noqa: E402
from ort_lightning.fleet.server.assembly import device_folder  # noqa: E402
from tests.web.runner_job import node_run, write_job  # noqa: E402

LR = 0.01
HIDDEN = 16
DEVICES = 3
DATA = DigitsPartitions(batch_size=32, seed=0)  # shuffles every epoch


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The digits MLP exported once (the server's folder) and its device folder (``prepare_for_web``, lr 0.01)."""
    root = tmp_path_factory.mktemp("fleet-device")
    exported = export_artifacts(digits_mlp(HIDDEN, seed=0), torch.zeros(2, FEATURES), root / "exported",
                                nominal_checkpoint=True, ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "device", lr=LR)


@pytest.fixture(scope="module", autouse=True)
def _task_identity() -> None:
    """Flower stamps a Message with this process's task identity, which a grid claims as Flower's runtimes do."""
    LocalGrid(ClientApp(), nodes=1)


def _values(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(path)).parameters}


def _epochs(partition: int, epochs: int) -> list[list[torch.Tensor]]:
    """A device's batches of `epochs` epochs, as torch's DataLoader iterates its loader epoch after epoch."""
    loader = DATA(partition, DEVICES).train
    return [list(batch) for _ in range(epochs) for batch in loader]


def _fedavg(fits: list[tuple[dict[str, np.ndarray], int]]) -> dict[str, np.ndarray]:
    total = sum(count for _, count in fits)
    return {name: sum(values[name].astype(np.float64) * count for values, count in fits) / total
            for name in fits[0][0]}


def _assert_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray], atol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name].astype(np.float64), value, rtol=0, atol=atol, err_msg=name)


def _run(device: TrainingArtifacts, server: TrainingArtifacts, folder: Path, *, rounds: int, epochs: int,
         **options: Any) -> FleetServer:
    client = DeviceClient(device.directory, DATA, epochs=epochs, **options)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=DEVICES, min_train_nodes=DEVICES)
    fleet = FleetServer(GlobalModel(server), strategy, rounds=rounds, directory=folder)
    run_local(fleet.server_app(), client.client_app(), nodes=DEVICES)
    return fleet


# ----------------------------------------------------------------------------- exact FedAvg
@pytest.mark.parametrize("epochs", [1, 2, 3], ids=["1-epoch", "2-epochs", "3-epochs"])
def test_rounds_equal_the_fedavg_of_orts_documented_loop_on_the_device_folder(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, epochs: int
) -> None:
    exported, device = folders
    _run(device, exported, tmp_path, rounds=2, epochs=epochs)
    start = _values(exported.checkpoint)
    for number in (1, 2):
        # NOTE: lr None: the device folder's optimizer graph computes the rate, as in a browser.
        fits = [(ort_device_loop(device.directory, _epochs(p, epochs), lr=None, graphs="ort", values=start),
                 len(DATA(p, DEVICES).train.dataset)) for p in range(DEVICES)]  # type: ignore[arg-type]
        expected = _fedavg(fits)
        _assert_close(_values(round_path(tmp_path, number)), expected, atol=1e-6)
        start = {name: value.astype(np.float32) for name, value in expected.items()}


@pytest.fixture(scope="module")
def rated(folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The experiment's device folder for a config's ``lr`` (the one place the rate is written), once per rate."""
    made: dict[float, Path] = {}

    def folder(lr: float) -> Path:
        if lr not in made:
            folder = str(tmp_path_factory.mktemp(f"lr-{lr}"))
            config = FleetConfig.from_dict({"devices": {"lr": lr}, "output": {"folder": folder}})
            made[lr] = device_folder(config, folders[0].directory).directory
        return made[lr]

    return folder


@pytest.mark.parametrize("runner", ["ort", "lightning"])
@pytest.mark.parametrize("lr", [0.003, 0.05])
def test_the_configs_rate_is_what_every_runner_trains_at(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], rated: Any, runner: str, lr: float
) -> None:
    """A device's round, by either runner, equals plain torch's AdamW at the config's lr on the same batches."""
    exported, _ = folders
    reply = DeviceClient(rated(lr), DATA, runner=runner).train(_message(_values(exported.checkpoint)), _context(0))
    trained = reply.content.array_records["arrays"].to_torch_state_dict()
    model = digits_mlp(HIDDEN, seed=0)  # the exported module; the artifacts' AdamW defaults are torch's
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in _epochs(0, 1):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=2e-5, msg=name)


def _kept_reference(folder: Path, start: dict[str, np.ndarray], tmp_path: Path) -> list[dict[str, np.ndarray]]:
    """Two FedAvg rounds in which each device keeps its ORT checkpoint (optimizer state included) between them."""
    saved: dict[int, Path] = {}
    averages = []
    for number in (1, 2):
        fits = []
        for p in range(DEVICES):
            state, module, optimizer = ort_device_start(folder, graphs="ort", values=start, checkpoint=saved.get(p))
            module.train()
            for batch in _epochs(p, 1):
                module(*(tensor.numpy() for tensor in batch))
                optimizer.step()
                module.lazy_reset_grad()
            saved[p] = tmp_path / f"kept-{p}-{number}.ckpt"
            CheckpointState.save_checkpoint(state, str(saved[p]), include_optimizer_state=True)
            fits.append(({name: np.array(q.data) for name, q in state.parameters},
                         len(DATA(p, DEVICES).train.dataset)))  # type: ignore[arg-type]
            del optimizer, module, state
        averages.append(_fedavg(fits))
        start = {name: value.astype(np.float32) for name, value in averages[-1].items()}
    return averages


def test_kept_optimizer_state_continues_the_devices_step_and_moments(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, device = folders
    _run(device, exported, tmp_path / "keep", rounds=2, epochs=1, optimizer_state="keep")
    _run(device, exported, tmp_path / "fresh", rounds=2, epochs=1)
    expected = _kept_reference(device.directory, _values(exported.checkpoint), tmp_path)
    for number, average in enumerate(expected, start=1):
        _assert_close(_values(round_path(tmp_path / "keep", number)), average, atol=1e-6)
    # a kept state is not a fresh one: round 2 differs where the moments and the step carry on
    kept, fresh = _values(round_path(tmp_path / "keep", 2)), _values(round_path(tmp_path / "fresh", 2))
    assert max(float(np.abs(kept[n] - fresh[n]).max()) for n in kept) > 1e-4


# ----------------------------------------------------------------------------- one device, directly
def _message(values: dict[str, np.ndarray]) -> Message:
    content = RecordDict({"arrays": ArrayRecord({n: torch.from_numpy(v) for n, v in values.items()}),
                          "config": ConfigRecord({"server-round": 1})})
    return Message(content, dst_node_id=1, message_type="train")


def _context(partition: int) -> Context:
    return Context(1, 1, {"partition-id": partition, "num-partitions": DEVICES}, RecordDict(), {})


def test_a_device_frees_what_it_built_and_its_worker_memory_stays_flat(
    folders: tuple[TrainingArtifacts, TrainingArtifacts]
) -> None:
    exported, device = folders
    client = DeviceClient(device.directory, DATA, epochs=1)
    start = _values(exported.checkpoint)

    def rounds(count: int) -> None:
        for number in range(count):
            reply = client.train(_message(start), _context(number % DEVICES))
            assert not reply.has_error()

    rounds(30)  # warm-up: ORT's arenas, the folder read once, Python's caches
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rounds(300)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 8, f"the worker's peak memory grew {grown_mb:.1f} MB over 300 device rounds"


def test_a_device_reports_its_set_up_fit_and_steps(folders: tuple[TrainingArtifacts, TrainingArtifacts]) -> None:
    exported, device = folders
    reply = DeviceClient(device.directory, DATA, epochs=2).train(_message(_values(exported.checkpoint)), _context(0))
    metrics = reply.content.metric_records["metrics"]
    batches = len(DATA(0, DEVICES).train)
    assert metrics["steps"] == 2 * batches
    assert metrics["num-examples"] == len(DATA(0, DEVICES).train.dataset)  # type: ignore[arg-type]
    assert 0 < metrics["setup_seconds"] < 5  # type: ignore[operator]
    assert 0 < metrics["fit_seconds"] < 5  # type: ignore[operator]
    assert metrics["steps_per_second"] == pytest.approx(metrics["steps"] / metrics["fit_seconds"])  # type: ignore[operator]


def test_the_experiment_prints_and_records_the_devices_timings(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exported, _ = folders
    config = FleetConfig.from_dict({"devices": {"count": DEVICES, "epochs": 1, "lr": LR, "batch_size": 32},
                                    "rounds": 1, "model": {"hidden": HIDDEN}, "output": {"folder": str(tmp_path)}})
    run_experiment(config, exported.directory, DATA, test=digits_test_loader(0))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("round  1"))
    assert re.search(r"[\d.]+ ms mean local fit, [\d.]+ ms set-up, \d+ steps/s", line), line
    train = json.loads((tmp_path / "history.json").read_text())["rounds"][0]["train"]
    assert {"setup_seconds", "fit_seconds", "steps_per_second", "steps"} <= set(train)
    assert (tmp_path / "device" / "training_model.ort").is_file()  # the folder a browser loads too


def test_a_device_evaluates_through_its_eval_graph_as_torch_computes(
    folders: tuple[TrainingArtifacts, TrainingArtifacts]
) -> None:
    exported, device = folders
    message = Message(RecordDict({"arrays": _message(_values(exported.checkpoint)).content.array_records["arrays"]}),
                      dst_node_id=1, message_type="evaluate")
    metrics = DeviceClient(device.directory, DATA).evaluate(message, _context(2)).content.metric_records["metrics"]
    x, y = DATA(2, DEVICES).test.dataset.tensors  # type: ignore[union-attr]
    with torch.no_grad():
        logits = digits_mlp(HIDDEN, seed=0)(x)  # the exported module: the checkpoint's values
    assert metrics["num-examples"] == len(y)
    assert metrics["eval_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert metrics["eval_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))


# ----------------------------------------------------------------------------- bad input
def test_the_experiment_needs_the_devices_data(folders: tuple[TrainingArtifacts, TrainingArtifacts],
                                               tmp_path: Path) -> None:
    config = FleetConfig.from_dict({"devices": {"count": 2}, "rounds": 1, "output": {"folder": str(tmp_path)}})
    message = r"Expected `data`, each device's \(partition, partitions\) -> ClientData, for engine 'local'"
    with pytest.raises(ConfigurationError, match=message + ", but got None; pass the devices' data"):
        run_experiment(config, folders[0].directory, None)


def test_a_nominal_start_without_a_nominal_checkpoint_is_named(tmp_path: Path) -> None:
    plain = export_artifacts(digits_mlp(HIDDEN), torch.zeros(2, FEATURES), tmp_path / "plain", verify=False)
    client = DeviceClient(plain.directory, DATA, start="nominal")
    with pytest.raises(ConfigurationError, match=r"\"nominal\" needs a nominal checkpoint .*nominal_checkpoint=True"):
        client.loop()


def test_a_client_refuses_an_unknown_runner_and_options_its_runner_ignores(
    folders: tuple[TrainingArtifacts, TrainingArtifacts]
) -> None:
    _, device = folders
    unknown = r"Expected `runner` to be one of \('ort', 'lightning'\), but got 'tf'; pass \"ort\""
    with pytest.raises(ConfigurationError, match=unknown):
        DeviceClient(device.directory, DATA, runner="tf")
    ignored = r"configure the Trainer of runner=\"lightning\", but this client runs ONNX Runtime's device loop"
    with pytest.raises(ConfigurationError, match=ignored):
        DeviceClient(device.directory, DATA, trainer_options={"max_steps": 2})


def test_values_of_another_model_are_refused_by_name(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    _, device = folders
    other = export_artifacts(digits_mlp(8), torch.zeros(2, FEATURES), tmp_path / "other", verify=False)
    message = _message(_values(other.checkpoint))
    with pytest.raises(ConfigurationError, match=r"the device folder trains .*start the FleetServer from the artif"):
        DeviceClient(device.directory, DATA).train(message, _context(0))


def test_a_supernode_trains_at_the_run_configs_rate(folders: tuple[TrainingArtifacts, TrainingArtifacts]) -> None:
    """A SuperNode prepares a plain folder at the run config's lr, and refuses a folder prepared at another rate."""
    from ort_lightning.fleet.engines.deployment import client

    exported, device = folders
    start = _values(exported.checkpoint)

    def reply(artifacts: Path, lr: float) -> Message:
        run_config = {"model.artifacts": str(artifacts), "devices.count": DEVICES, "devices.lr": lr,
                      "devices.batch_size": 32, "seed": 0}
        return client(_message(start), Context(1, 1, {"partition-id": 1, "num-partitions": DEVICES}, RecordDict(),
                                                run_config))

    trained = reply(exported.directory, LR)
    assert not trained.has_error(), trained.error
    expected = ort_device_loop(device.directory, _epochs(1, 1), lr=None, graphs="ort", values=start)
    _assert_close({n: a.numpy() for n, a in trained.content.array_records["arrays"].items()}, expected, atol=1e-6)
    with pytest.raises(ConfigurationError, match=r"The run config's devices.lr=0.05, but the device folder .* computes "
                                                 r"its own rate \(constant 0.01, .*pass devices.lr=0.01 in the run "):
        reply(device.directory, 0.05)


# ----------------------------------------------------------------------------- faults, as for every device
HUNG, FAILING, NAN = 0, 1, 2
RELEASE = threading.Event()


def _faulty_data(partition: int, partitions: int) -> ClientData:
    """Device 0 hangs until released, device 1 raises, device 2's features are NaN; 3 and 4 are healthy."""
    data = DATA(partition, partitions)
    if partition == HUNG:
        RELEASE.wait(60)
    if partition == FAILING:
        raise RuntimeError("this device's storage is gone")
    if partition == NAN:
        x, y = data.train.dataset.tensors  # type: ignore[attr-defined]
        return ClientData(train=DataLoader(TensorDataset(torch.full_like(x, float("nan")), y), batch_size=32))
    return data


def test_a_hung_a_failing_and_a_diverging_device_leave_the_round_to_the_others(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, device = folders
    RELEASE.clear()
    client = DeviceClient(device.directory, _faulty_data, epochs=1)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=5, min_train_nodes=5)
    fleet = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=tmp_path, device_timeout=3.0)
    try:
        run_local(fleet.server_app(), client.client_app(), nodes=5)
    finally:
        RELEASE.set()
    [record] = fleet.history
    assert sorted(record.failures) == [HUNG + 1, FAILING + 1, NAN + 1]  # LocalGrid's node ids count from 1
    assert "did not answer within the device timeout of 3 s" in record.failures[HUNG + 1]
    assert "RuntimeError: this device's storage is gone" in record.failures[FAILING + 1]
    assert re.search(r"NonFiniteLossError: The device's training loss is nan at step 1 of local epoch 1",
                     record.failures[NAN + 1])
    start = _values(exported.checkpoint)
    fits = [(ort_device_loop(device.directory, list(DATA(p, 5).train), lr=None, graphs="ort", values=start),
             len(DATA(p, 5).train.dataset)) for p in (3, 4)]  # type: ignore[arg-type]
    _assert_close(_values(round_path(tmp_path, 1)), _fedavg(fits), atol=1e-6)


# ----------------------------------------------------------------------------- no Lightning on a device
#: A SuperNode's process with Lightning absent: it loads the deployment's app and trains one round through it.
_WITHOUT_LIGHTNING = """
import sys
sys.modules.update(dict.fromkeys(("lightning", "pytorch_lightning", "lightning_fabric")))  # None: import fails
import numpy as np, torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from ort_lightning.fleet.engines.deployment import client
from ort_lightning.fleet.engines.local import LocalGrid

folder, values, out, partitions = sys.argv[1], np.load(sys.argv[2]), sys.argv[3], int(sys.argv[4])
LocalGrid(ClientApp(), nodes=1)  # the task identity Flower stamps on a Message
arrays = ArrayRecord({name: torch.from_numpy(values[name]) for name in values.files})
message = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}), dst_node_id=1,
                  message_type="train")
run_config = {"model.artifacts": folder, "devices.count": partitions, "devices.epochs": 1, "devices.lr": 0.01,
              "devices.batch_size": 32, "seed": 0}
context = Context(1, 1, {"partition-id": 1, "num-partitions": partitions}, RecordDict(), run_config)
reply = client(message, context)
assert not reply.has_error(), reply.error
np.savez(out, **{name: array.numpy() for name, array in reply.content.array_records["arrays"].items()})
print(sorted(name for name, module in sys.modules.items() if module is not None
             and (name.split(".")[0] == "lightning" or name.startswith("ort_lightning.training"))))
"""


@pytest.mark.slow
def test_a_supernode_trains_a_round_with_lightning_absent(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    import subprocess
    import sys

    exported, device = folders
    start = _values(exported.checkpoint)
    np.savez(tmp_path / "start.npz", **start)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LIGHTNING, str(device.directory), str(tmp_path / "start.npz"),
         str(tmp_path / "trained.npz"), str(DEVICES)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"  # neither Lightning nor the Trainer's side of the package was loaded
    trained = np.load(tmp_path / "trained.npz")
    expected = ort_device_loop(device.directory, _epochs(1, 1), lr=None, graphs="ort", values=start)
    _assert_close({name: trained[name] for name in trained.files}, expected, atol=1e-6)


# ----------------------------------------------------------------------------- Node: the same round
@pytest.mark.slow
@RunIf(node=True)
@pytest.mark.parametrize(("epochs", "lr"), [(1, 0.05), (2, LR), (3, LR)],
                         ids=["1-epoch-at-0.05", "2-epochs", "3-epochs"])
def test_node_runs_a_devices_round_as_the_python_device_does(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], rated: Any, tmp_path: Path, epochs: int, lr: float
) -> None:
    """Node trains the device folder as the Python device does, at the rate of the config that wrote it."""
    exported, _ = folders
    device = rated(lr)
    start = _values(exported.checkpoint)
    reply = DeviceClient(device, DATA, epochs=epochs).train(_message(start), _context(1))
    python = reply.content.array_records["arrays"].to_numpy_ndarrays()
    # the page's loop: each epoch's batches in turn (one `train` each), here as one list of every epoch's batches
    order = DeviceClient(device, DATA).loop().exchange.full.names  # type: ignore[attr-defined]
    weights = np.concatenate([start[name].ravel() for name in order])
    batches = [tuple(tensor.numpy() for tensor in batch) for batch in _epochs(1, epochs)]
    job = write_job(tmp_path, device, "ort", weights, batches)
    job.write_text(json.dumps({**json.loads(job.read_text()), "epochs": 1}))
    result, trained, _ = node_run(job)
    assert result["steps"] == len(batches)
    # NOTE: the README's tolerance for browsers: 1e-5 per 1e-3 of rate
    np.testing.assert_allclose(trained, np.concatenate([array.ravel() for array in python]), rtol=0,
                               atol=1e-5 * lr / 1e-3)
