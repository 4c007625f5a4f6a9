"""Fleet experiments on Flower: FedAvg of ORT-trained devices against the same rounds computed by hand.

The reference never goes through ort_lightning.fleet: each device is an independent Lightning fit
of an ORTLightningModule started from an ORT checkpoint file, and the average is taken here, in
float64, weighted by each device's example count.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.storage.atomic import verify_digest
from tests.conftest import MLP, Exported, blobs

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    ClientData,
    DeviceClient,
    GlobalModel,
    LocalGrid,
    WeightOrder,
    get_values,
    round_path,
    run_local,
    set_values,
)
from ort_lightning.fleet.server.server_app import FleetServer  # noqa: E402
from tests.fleet.fedavg_by_hand import (  # noqa: E402
    EPOCHS,
    LR,
    SIZES,
    assert_values_close,
    fedavg_by_hand,
    iid_data,
    module_values,
    values_in,
)

pytestmark = pytest.mark.slow


def label_data(partition: int, partitions: int) -> ClientData:
    """Non-IID: device i holds only label i (and a different number of samples each)."""
    x, y = blobs(120, seed=8)
    mine = torch.nonzero(y == partition).flatten()[: SIZES[partition]]
    return ClientData(train=DataLoader(TensorDataset(x[mine], y[mine]), batch_size=4))


# ----------------------------------------------------------------------------- the reference


def _run(
    exported: Exported, data: Any, folder: Path, *, rounds: int, devices: Path, mods: list[Any] | None = None,
    start: str = "auto",
) -> FleetServer:
    """`rounds` of FedAvg over `devices` (the device folder each device holds, at LR) with Trainer devices."""
    client = DeviceClient(devices, data, epochs=EPOCHS, runner="lightning", start=start)
    server = FleetServer(GlobalModel(exported.artifacts), FedAvg(fraction_evaluate=0.0), rounds=rounds,
                         directory=folder)
    run_local(server.server_app(), client.client_app(mods=mods), nodes=len(SIZES))
    return server


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The MLP's artifacts with the nominal checkpoint a device ships."""
    torch.manual_seed(0)
    model = MLP()
    pristine = copy.deepcopy(model)
    folder = tmp_path_factory.mktemp("shipped") / "artifacts"
    return Exported(export_artifacts(model, torch.zeros(2, 4), folder, verify=False, nominal_checkpoint=True), pristine)


def _weightless(artifacts: TrainingArtifacts, folder: Path) -> Path:
    """A device folder: the graphs and the nominal checkpoint; the complete one (the weights) stays with the server."""
    shutil.copytree(artifacts.directory, folder)
    (folder / "checkpoint").unlink()
    assert TrainingArtifacts.load(folder).weightless
    return folder


# ----------------------------------------------------------------------------- tests
def test_values_follow_the_training_graph_and_land_in_ort_memory(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    assert WeightOrder.of(mlp_adamw.artifacts).names == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    address, session = module.fc1.weight.data_ptr(), module.ort_session
    reference = mlp_adamw.reference().state_dict()
    set_values(module, {name: torch.full_like(value, 0.5) for name, value in reference.items()})
    assert module.fc1.weight.data_ptr() == address
    assert module.ort_session is session  # copied into ORT's memory, nothing rebuilt
    x = torch.randn(5, 4)
    model = mlp_adamw.reference()
    for parameter in model.parameters():
        torch.nn.init.constant_(parameter, 0.5)
    torch.testing.assert_close(module(x), model(x))
    assert list(get_values(module)) == list(reference)


def test_set_values_refuses_values_of_other_artifacts(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    values = get_values(module)
    with pytest.raises(ValueError, match=r"\['fc2.bias'\] are missing"):
        set_values(module, {k: v for k, v in values.items() if k != "fc2.bias"})
    with pytest.raises(ValueError, match=r"Expected value 'fc1.bias' of shape \(8,\), but got \(3,\)"):
        set_values(module, {**values, "fc1.bias": torch.zeros(3)})


def test_fedavg_rounds_match_independent_fits_averaged_by_example_count(
    mlp_adamw: Exported, device_folder: Any, tmp_path: Path
) -> None:
    server = _run(mlp_adamw, iid_data, tmp_path / "rounds", rounds=2, devices=device_folder(mlp_adamw.artifacts, LR))
    expected = fedavg_by_hand(mlp_adamw, iid_data, [[0, 1, 2], [0, 1, 2]], tmp_path)

    for number, (average, fits) in enumerate(expected, start=1):
        path = round_path(tmp_path / "rounds", number)
        assert verify_digest(path)
        assert_values_close(values_in(mlp_adamw, path), average)
        # the test can fail: the devices moved apart, and the plain mean is not the weighted one
        assert max(float((fit["fc1.weight"] - average["fc1.weight"].float()).abs().max()) for fit in fits) > 1e-3
        plain = sum(fit["fc1.weight"].double() for fit in fits) / len(fits)
        assert float((plain - average["fc1.weight"]).abs().max()) > 1e-4
    assert [r.server_round for r in server.history] == [1, 2]
    assert [(r.devices, r.examples) for r in server.history] == [(3, sum(SIZES))] * 2
    last = tmp_path / "rounds" / "last.ortckpt"
    assert last.read_bytes() == round_path(tmp_path / "rounds", 2).read_bytes()


def test_devices_from_the_nominal_checkpoint_equal_the_complete_start_and_the_reference(
    shipped: Exported, device_folder: Any, tmp_path: Path
) -> None:
    """Devices holding no weights at all (ORT's nominal start, the server's values) == the complete start == by hand."""
    nominal = shipped.artifacts.nominal_checkpoint
    assert nominal is not None
    with pytest.raises(RuntimeError, match="nominal state"):  # ORT holds names and shapes, no data
        CheckpointState.load_checkpoint(str(nominal)).parameters["fc1.weight"]  # noqa: B018 - reading is the check
    assert 2 * nominal.stat().st_size < shipped.artifacts.checkpoint.stat().st_size
    complete = device_folder(shipped.artifacts, LR)
    devices = _weightless(TrainingArtifacts.load(complete), tmp_path / "device")

    from_nominal = _run(shipped, iid_data, tmp_path / "nominal", rounds=2, devices=devices)  # start="auto"
    from_complete = _run(shipped, iid_data, tmp_path / "complete", rounds=2, devices=complete, start="complete")
    expected = fedavg_by_hand(shipped, iid_data, [[0, 1, 2], [0, 1, 2]], tmp_path)

    for server in (from_nominal, from_complete):  # a device that failed would only be left out of the average
        assert [(r.devices, r.examples) for r in server.history] == [(3, sum(SIZES))] * 2
    for number, (average, _) in enumerate(expected, start=1):
        started_nominal = values_in(shipped, round_path(tmp_path / "nominal", number))
        started_complete = values_in(shipped, round_path(tmp_path / "complete", number))
        # NOTE: two runs of one start differ by up to ~4e-7 (ORT's float32 sums), so equal means to 1e-6
        for name, value in started_complete.items():
            torch.testing.assert_close(started_nominal[name], value, rtol=0, atol=1e-6, msg=name)
        assert_values_close(started_nominal, average)


def test_nominal_start_without_a_nominal_checkpoint_is_named(mlp_adamw: Exported) -> None:
    with pytest.raises(ValueError, match=r"Expected `start` to be one of \('auto', 'nominal', 'complete'\)"):
        DeviceClient(mlp_adamw.artifacts.directory, iid_data, runner="lightning", start="weightless")
    client = DeviceClient(mlp_adamw.artifacts.directory, iid_data, runner="lightning", start="nominal")
    grid = LocalGrid(client.client_app(), nodes=1)
    content = RecordDict({"arrays": ArrayRecord(get_values(ORTLightningModule(mlp_adamw.artifacts))),
                          "config": ConfigRecord({"server-round": 1})})
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=1, message_type="train")])
    assert reply.has_error()
    needs = r'start="nominal" needs a nominal checkpoint in .*export_artifacts\(\.\.\., nominal_checkpoint=True\)'
    assert re.search(needs, reply.error.reason), reply.error.reason


def test_complete_start_on_a_device_folder_is_named(shipped: Exported, tmp_path: Path) -> None:
    devices = _weightless(shipped.artifacts, tmp_path / "device")
    client = DeviceClient(devices, iid_data, runner="lightning", start="complete")
    grid = LocalGrid(client.client_app(), nodes=1)
    content = RecordDict({"arrays": ArrayRecord(get_values(ORTLightningModule(shipped.artifacts))),
                          "config": ConfigRecord({"server-round": 1})})
    (reply,) = grid.send_and_receive([Message(content, dst_node_id=1, message_type="train")])
    assert reply.has_error()
    needs = (r'start="complete" needs the complete checkpoint in .*, but the folder holds no weights .*pass '
             r'start="nominal" or "auto"')
    assert re.search(needs, reply.error.reason), reply.error.reason


def _fail(rounds_to_devices: dict[int, set[int]]) -> Callable[..., Message]:
    """A Flower mod: the listed devices raise in the listed rounds (a device lost mid-round)."""

    def mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        server_round = int(message.content.config_records["config"]["server-round"])
        if int(context.node_config["partition-id"]) in rounds_to_devices.get(server_round, set()):
            raise RuntimeError(f"device lost in round {server_round}")
        return call_next(message, context)

    return mod


def test_non_iid_round_survives_a_failing_device_and_keeps_earlier_checkpoints(
    mlp_adamw: Exported, device_folder: Any, tmp_path: Path
) -> None:
    folder = tmp_path / "rounds"
    # round 2: device 1 fails; round 3: every device fails
    server = _run(mlp_adamw, label_data, folder, rounds=3, devices=device_folder(mlp_adamw.artifacts, LR),
                  mods=[_fail({2: {1}, 3: {0, 1, 2}})])
    expected = fedavg_by_hand(mlp_adamw, label_data, [[0, 1, 2], [0, 2]], tmp_path)

    for number, (average, _) in enumerate(expected, start=1):
        assert verify_digest(round_path(folder, number))
        assert_values_close(values_in(mlp_adamw, round_path(folder, number)), average)
    assert [(r.devices, r.examples) for r in server.history] == [(3, sum(SIZES)), (2, SIZES[0] + SIZES[2]), (0, 0)]
    assert server.history[2].checkpoint is None
    assert not round_path(folder, 3).exists()
    digest = hashlib.sha256(round_path(folder, 2).read_bytes()).hexdigest()
    assert hashlib.sha256((folder / "last.ortckpt").read_bytes()).hexdigest() == digest
    assert verify_digest(folder / "last.ortckpt")


def test_resumed_server_continues_round_numbers_from_the_checkpoint(
    mlp_adamw: Exported, device_folder: Any, tmp_path: Path
) -> None:
    first = _run(mlp_adamw, iid_data, tmp_path / "a", rounds=1, devices=device_folder(mlp_adamw.artifacts, LR))
    resumed = GlobalModel(mlp_adamw.artifacts, checkpoint=first.history[0].checkpoint)
    assert resumed.server_round == 1
    written = values_in(mlp_adamw, round_path(tmp_path / "a", 1))
    assert_values_close(module_values(resumed.module), {name: value.double() for name, value in written.items()})


def test_kept_optimizer_state_continues_the_devices_adamw_step(
    mlp_adamw: Exported, device_folder: Any, tmp_path: Path
) -> None:
    """optimizer_state="keep": a device's second round starts at its own AdamW step, not at step 0."""
    client = DeviceClient(device_folder(mlp_adamw.artifacts, LR), iid_data, epochs=1, runner="lightning",
                          optimizer_state="keep")
    server = FleetServer(GlobalModel(mlp_adamw.artifacts), FedAvg(fraction_evaluate=0.0), rounds=2,
                         directory=tmp_path / "keep")
    grid = LocalGrid(client.client_app(), nodes=len(SIZES))
    server.main(grid, Context(1, 0, {}, RecordDict(), {}))
    steps = []
    for context in map(grid.context, grid.get_node_ids()):
        stored = context.state.array_records["ort_lightning_device_checkpoint"].to_torch_state_dict()["checkpoint"]
        path = tmp_path / f"device-{context.node_id}.ortckpt"
        path.write_bytes(stored.numpy().tobytes())
        steps.append(ORTLightningModule(mlp_adamw.artifacts, checkpoint=path).start_progress["global_step"])
    assert steps == [2 * (size // 4) for size in SIZES]


@pytest.mark.alone  # Ray
def test_flower_ray_simulation_runs_the_same_round(mlp_adamw: Exported, device_folder: Any, tmp_path: Path) -> None:
    """One true run on Flower's simulation engine (Ray): 2 devices, 1 round, the same numbers as by hand."""
    from flwr.simulation import run_simulation

    client = DeviceClient(device_folder(mlp_adamw.artifacts, LR), iid_data, epochs=EPOCHS, runner="lightning")
    server = FleetServer(GlobalModel(mlp_adamw.artifacts), FedAvg(fraction_evaluate=0.0), rounds=1,
                         directory=tmp_path / "rounds")
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}}
    run_simulation(server.server_app(), client.client_app(), num_supernodes=2, backend_config=backend)

    ((average, _),) = fedavg_by_hand(mlp_adamw, iid_data, [[0, 1]], tmp_path)
    assert [(r.devices, r.examples) for r in server.history] == [(2, SIZES[0] + SIZES[1])]
    assert_values_close(values_in(mlp_adamw, round_path(tmp_path / "rounds", 1)), average)


def test_fleet_command_prints_accuracy_per_round_and_writes_each_round(tmp_path: Path) -> None:
    from tests.cli.script import run_script

    config = tmp_path / "fleet.yaml"
    config.write_text(f"output: {{folder: {tmp_path / 'run'}}}\ndevices: {{count: 3, epochs: 1}}\nrounds: 2\n"
                      "model: {hidden: 16, verify: false}\n", encoding="utf-8")
    shown = run_script("fleet", "--config", config, cwd=tmp_path).stdout
    accuracies = [float(a) for a in re.findall(r"^round +\d: accuracy ([\d.]+)%", shown, re.MULTILINE)]
    assert len(accuracies) == 3, shown
    assert accuracies[2] > accuracies[0], shown
    assert verify_digest(tmp_path / "run" / "rounds" / "round-0002.ortckpt")
    history = json.loads((tmp_path / "run" / "history.json").read_text(encoding="utf-8"))
    assert [r["devices"] for r in history["rounds"]] == [3, 3]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"data": {"partition": "shards"}}, r"Expected `data.partition` to be one of \['iid', 'label', 'dirichlet', "
         r"'ordered', 'writers'\], but got 'shards'"),
        ({"strategy": {"name": "fedsgd"}}, r"Expected `strategy.name` to be one of \['fedavg'.*but got 'fedsgd'"),
        ({"devices": {"count": 0}}, r"Expected devices.count, devices.epochs and devices.batch_size >= 1, but got 0, "),
        ({"device": {}}, r"Unknown key `device` in the fleet config; did you mean `devices`\?"),
        ({"devices": {"runner": "trainer"}}, r"Expected `devices.runner` to be one of \['ort', 'lightning'\], but "),
    ],
    ids=["split", "strategy", "devices", "unknown-key", "runner"],
)
def test_fleet_config_mistakes_are_named(values: dict[str, Any], message: str) -> None:
    from ort_lightning.fleet.run import FleetConfig

    with pytest.raises(ValueError, match=message):
        FleetConfig.from_dict(values)


def test_evaluation_through_the_eval_graph_matches_torch(mlp_adamw: Exported) -> None:
    from ort_lightning.fleet import evaluate_module

    x, y = blobs(50, seed=9)
    result = evaluate_module(ORTLightningModule(mlp_adamw.artifacts), DataLoader(TensorDataset(x, y), batch_size=16))
    model = mlp_adamw.reference()
    with torch.no_grad():
        logits = model(x)
    assert result["examples"] == 50
    assert result["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert result["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
