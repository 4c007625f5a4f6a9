"""Federated LoRA: only the adapters cross the wire, the base stays byte-identical, FFA-LoRA averages exactly.

The reference is ONNX Runtime's documented loop (``tests.helpers.ort_device_loop``) on the device
folder's complete checkpoint with every value copied in, fed the batches torch's ``DataLoader``
iterates, averaged by example count in float64; and the products B·A computed here in float64.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import FEATURES, digits_mlp
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import prepare_for_web
from tests.helpers import ROOT, ort_device_loop

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
peft = pytest.importorskip("peft", reason='peft is not installed: pip install -e ".[test]"')

from flwr.app import ArrayRecord, Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import DeviceClient, FleetServer, GlobalModel, LocalGrid, round_path, run_local  # noqa: E402
from ort_lightning.fleet.config.fleet_config import FleetConfig  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions  # noqa: E402
from ort_lightning.fleet.server.lora import check_ffa, freeze_lora_a  # noqa: E402

LR = 0.02
EPOCHS = 2
DEVICES = 3
DATA = DigitsPartitions(batch_size=32, seed=0)
#: Unshuffled: a Trainer draws its own epochs' orders from a shuffling loader.
FIXED = DigitsPartitions(batch_size=32, seed=0, shuffle=False)
#: The bytes of one ``.npy`` header Flower's ``Array`` carries per tensor (an upper bound).
NPY_HEADER = 128


def _lora_mlp(*, ffa: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights="gaussian")
    model = peft.get_peft_model(digits_mlp(32, seed=0), config)
    if ffa:
        freeze_lora_a(model)
    return model


@dataclass
class Run:
    """A fleet's round files and what crossed the wire: per round and device, the names sent and the reply."""

    exported: TrainingArtifacts
    device: TrainingArtifacts
    folder: Path
    server: FleetServer
    sent: dict[int, list[list[str]]] = field(default_factory=dict)
    replies: dict[int, dict[int, dict[str, np.ndarray]]] = field(default_factory=dict)


def _recorder(run: Run) -> Callable[[Message, Context, Any], Message]:
    def mod(message: Message, context: Context, call_next: Any) -> Message:
        server_round = int(message.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
        run.sent.setdefault(server_round, []).append(list(message.content.array_records["arrays"]))
        reply: Message = call_next(message, context)
        arrays = reply.content.array_records["arrays"]
        partition = int(context.node_config["partition-id"])
        run.replies.setdefault(server_round, {})[partition] = {name: arrays[name].numpy() for name in arrays}
        return reply

    return mod


def _fleet(root: Path, *, ffa: bool, rounds: int) -> Run:
    exported = export_artifacts(_lora_mlp(ffa=ffa), torch.zeros(2, FEATURES), root / "exported",
                                nominal_checkpoint=True, ort_format=True, verify=False)
    device = prepare_for_web(exported, root / "device", lr=LR)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=DEVICES, min_train_nodes=DEVICES)
    server = FleetServer(GlobalModel(exported), strategy, rounds=rounds, directory=root / "rounds")
    run = Run(exported, device, root / "rounds", server)
    LocalGrid(ClientApp(), nodes=1)  # Flower's task identity in this process, as a grid claims it
    client = DeviceClient(device.directory, DATA, epochs=EPOCHS)
    run_local(server.server_app(), client.client_app(mods=[_recorder(run)]), nodes=DEVICES)
    return run


@pytest.fixture(scope="module")
def separate(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two rounds of a LoRA fleet whose devices train A and B (FlowerTune's way)."""
    return _fleet(tmp_path_factory.mktemp("lora-separate"), ffa=False, rounds=2)


@pytest.fixture(scope="module")
def ffa(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One round of the same fleet with every A frozen (FFA-LoRA)."""
    return _fleet(tmp_path_factory.mktemp("lora-ffa"), ffa=True, rounds=1)


def _values(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(path)).parameters}


def _epochs(partition: int, data: DigitsPartitions = DATA) -> list[list[torch.Tensor]]:
    loader = data(partition, DEVICES).train
    return [list(batch) for _ in range(EPOCHS) for batch in loader]


def _examples(partition: int) -> int:
    return len(DATA(partition, DEVICES).train.dataset)  # type: ignore[arg-type]


def _fedavg(fits: list[tuple[dict[str, np.ndarray], int]], names: list[str]) -> dict[str, np.ndarray]:
    total = sum(count for _, count in fits)
    return {name: sum(values[name].astype(np.float64) * count for values, count in fits) / total for name in names}


# ----------------------------------------------------------------------------- the wire and the reference
def test_only_the_adapters_travel_and_rounds_equal_the_fedavg_of_orts_loop(separate: Run) -> None:
    manifest = separate.exported.manifest
    adapters, frozen = list(manifest.trainable), list(manifest.frozen)
    assert all(".lora_" in name for name in adapters)
    assert len(frozen) == 4  # the base never trains
    for server_round in (1, 2):
        assert separate.sent[server_round] == [adapters] * DEVICES
        assert all(sorted(reply) == sorted(adapters) for reply in separate.replies[server_round].values())

    start = _values(separate.exported.checkpoint)
    for number, expected in enumerate(_reference(separate, rounds=2), start=1):
        written = _values(round_path(separate.folder, number))
        for name in adapters:
            np.testing.assert_allclose(written[name].astype(np.float64), expected[name], rtol=0, atol=1e-6,
                                       err_msg=name)
        for name in frozen:  # byte-identical to the export: on the server and on every device's reply path
            assert written[name].tobytes() == start[name].tobytes(), name


def _reference(run: Run, *, rounds: int, data: DigitsPartitions = DATA) -> list[dict[str, np.ndarray]]:
    """Per round, the float64 FedAvg of ORT's documented loop per device over the adapters (every value copied in)."""
    start, averages = _values(run.exported.checkpoint), []
    for _ in range(rounds):
        # NOTE: lr None: the device folder's optimizer graph computes the rate, as in a browser.
        fits = [(ort_device_loop(run.device.directory, _epochs(p, data), lr=None, graphs="ort",
                                 checkpoint=run.device.checkpoint, values=start), _examples(p))
                for p in range(DEVICES)]
        averages.append(_fedavg(fits, list(run.exported.manifest.trainable)))
        start = {**start, **{name: value.astype(np.float32) for name, value in averages[-1].items()}}
    return averages


def test_trainer_devices_exchange_the_adapters_alone_too(separate: Run, tmp_path: Path) -> None:
    """``runner="lightning"``: a Trainer's fit per device, from the complete checkpoint, the adapters sent."""
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=DEVICES, min_train_nodes=DEVICES)
    server = FleetServer(GlobalModel(separate.exported), strategy, rounds=1, directory=tmp_path)
    client = DeviceClient(separate.device.directory, FIXED, epochs=EPOCHS, runner="lightning")
    run_local(server.server_app(), client.client_app(), nodes=DEVICES)
    [expected] = _reference(separate, rounds=1, data=FIXED)
    written, start = _values(round_path(tmp_path, 1)), _values(separate.exported.checkpoint)
    for name, value in expected.items():
        np.testing.assert_allclose(written[name].astype(np.float64), value, rtol=0, atol=2e-6, err_msg=name)
    for name in separate.exported.manifest.frozen:
        assert written[name].tobytes() == start[name].tobytes(), name


def test_bytes_per_device_round_are_the_adapters_plus_framing(separate: Run) -> None:
    values = _values(separate.exported.checkpoint)
    adapters = sum(values[name].nbytes for name in separate.exported.manifest.trainable)
    whole = sum(value.nbytes for value in values.values())
    assert adapters * 5 < whole  # the base is most of the model
    for record in separate.server.history:
        assert adapters <= record.sent_bytes <= adapters + NPY_HEADER * len(separate.exported.manifest.trainable)
        assert record.received_bytes == record.sent_bytes


def test_batchnorm_statistics_travel_beside_the_trainable_values_and_the_frozen_stay(tmp_path: Path) -> None:
    """A frozen layer and a BatchNorm: the device cuts the sent spans out of ORT's whole buffer (``spans``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 10))
    model[0].requires_grad_(False)
    exported = export_artifacts(model, torch.zeros(2, FEATURES), tmp_path / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    device = prepare_for_web(exported, tmp_path / "device", lr=LR)
    assert DeviceClient(device.directory, DATA).loop().exchange.mode == "spans"  # type: ignore[attr-defined]
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=DEVICES, min_train_nodes=DEVICES)
    server = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=tmp_path / "rounds")
    LocalGrid(ClientApp(), nodes=1)
    run_local(server.server_app(), DeviceClient(device.directory, DATA, epochs=EPOCHS).client_app(), nodes=DEVICES)
    start = _values(exported.checkpoint)
    sent = [name for name in start if name not in ("0.weight", "0.bias")]
    assert sorted(sent) == sorted([*exported.manifest.trainable, *exported.manifest.buffers])
    fits = [(ort_device_loop(device.directory, _epochs(p), lr=None, graphs="ort", checkpoint=device.checkpoint,
                             values=start), _examples(p)) for p in range(DEVICES)]
    expected = _fedavg(fits, sent)
    written = _values(round_path(tmp_path / "rounds", 1))
    for name in sent:
        np.testing.assert_allclose(written[name].astype(np.float64), expected[name], rtol=0, atol=1e-6, err_msg=name)
    assert not np.array_equal(written["1.running_mean"], start["1.running_mean"])
    for name in ("0.weight", "0.bias"):
        assert written[name].tobytes() == start[name].tobytes()


# ----------------------------------------------------------------------------- FFA-LoRA
def _products(values: dict[str, np.ndarray], layers: list[str]) -> dict[str, np.ndarray]:
    """B·A of each LoRA layer, in float64."""
    return {layer: values[f"{layer}.lora_B.default.weight"].astype(np.float64)
            @ values[f"{layer}.lora_A.default.weight"].astype(np.float64) for layer in layers}


def _gap(run: Run) -> float:
    """The largest difference between the aggregate's B·A and the example-weighted mean of the devices' B·A."""
    layers = ["base_model.model.0", "base_model.model.2"]
    start = _values(run.exported.checkpoint)
    total = sum(_examples(p) for p in range(DEVICES))
    mean = {layer: sum(_products({**start, **run.replies[1][p]}, layers)[layer] * _examples(p)
                       for p in range(DEVICES)) / total for layer in layers}
    aggregate = _products(_values(round_path(run.folder, 1)), layers)
    scale = max(float(np.abs(mean[layer]).max()) for layer in layers)
    return max(float(np.abs(aggregate[layer] - mean[layer]).max()) for layer in layers) / scale


def test_ffa_averages_the_products_exactly_and_separate_a_and_b_do_not(separate: Run, ffa: Run) -> None:
    assert not any(".lora_A." in name for name in ffa.exported.manifest.trainable)
    assert all(not any(".lora_A." in name for name in reply) for reply in ffa.replies[1].values())
    assert _gap(ffa) < 1e-6  # float32 rounding of the averaged B
    assert _gap(separate) > 1e-3  # mean(B)·mean(A) is not the mean of B·A


def test_ffa_needs_lora_and_frozen_a_matrices(separate: Run, ffa: Run) -> None:
    check_ffa(ffa.exported)
    with pytest.raises(ConfigurationError, match=r"`model.lora: ffa` trains B alone, but .* trains the LoRA A"):
        check_ffa(separate.exported)
    with pytest.raises(ConfigurationError, match=r"Expected a peft LoRA model \(trainable `lora_A` matrices\)"):
        freeze_lora_a(digits_mlp(8, seed=0))
    with pytest.raises(ConfigurationError, match=r"Expected `model.lora` to be one of \['separate', 'ffa'\]"):
        FleetConfig.from_dict({"model": {"lora": "average"}})


def test_the_server_takes_back_the_sent_tensors_alone(separate: Run) -> None:
    model = GlobalModel(separate.exported)
    arrays = model.arrays()
    assert list(arrays) == list(separate.exported.manifest.trainable)
    base = _values(separate.exported.checkpoint)["base_model.model.0.base_layer.weight"]
    with pytest.raises(ConfigurationError, match=r"Expected the values of the tensors a fleet sends \[.*\] \(every "
                                                 r"state tensor but the frozen parameters\), but got"):
        model.load(ArrayRecord({**arrays.to_torch_state_dict(), "base_model.model.0.base_layer.weight":
                                torch.from_numpy(base)}), server_round=1)


def test_a_frozen_base_is_read_from_the_complete_checkpoint_never_the_nominal_one(separate: Run) -> None:
    client = DeviceClient(separate.device.directory, DATA, start="nominal")
    with pytest.raises(ConfigurationError, match=r'freezes 4 parameters .* start="nominal" opens the nominal one'):
        client.loop()


@pytest.mark.slow
def test_a_hundred_lora_devices_in_one_process_hold_the_base_once(tmp_path: Path) -> None:
    """RSS after the 100th device within 5 % of RSS after the 10th (a copy of the base kept per device: +65 %)."""
    done = subprocess.run([sys.executable, "-m", "tests.fleet.devices.hundred_devices", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rss) == 100
    assert rss[99] <= 1.05 * rss[9], rss[::10]
