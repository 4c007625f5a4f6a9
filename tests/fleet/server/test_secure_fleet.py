"""A fleet through Flower's SecAgg+: what the server receives hides each update, and the aggregate is FedAvg's.

Everything each device sends is recorded at the transport (a Grid around `LocalGrid`). The reference
is ONNX Runtime's documented loop (``tests.helpers.ort_device_loop``) per device on the device folder,
averaged by example count in float64, never through ort_lightning.fleet. The bound is docs/fleets.md's:
``|A - F| <= N (2c + D / 2) / (T * sum(r)) + 2**-23 * max|F|`` with ``r = round(n / W * T) / T``.
"""

from __future__ import annotations

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
from tests.helpers import ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: E402

from ort_lightning.fleet import DeviceClient, GlobalModel, LocalGrid, round_path  # noqa: E402
from ort_lightning.fleet.config.fleet_config import ROBUST, FleetConfig  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions  # noqa: E402
from ort_lightning.fleet.devices.legacy_fit import NAMES_KEY  # noqa: E402
from ort_lightning.fleet.server.report import report  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer, secure_mods  # noqa: E402
from tests.fleet.recorder import Recorder  # noqa: E402
from tests.fleet.secure_bound import fedavg, secagg_bound  # noqa: E402

LR = 0.01
DEVICES = 3
DATA = DigitsPartitions(batch_size=32, seed=0)
SECAGG = {"num_shares": 3, "reconstruction_threshold": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The digits MLP (16 hidden, 1210 values) exported once, and its device folder at LR."""
    root = tmp_path_factory.mktemp("secure-fleet")
    exported = export_artifacts(digits_mlp(16, seed=0), torch.zeros(2, FEATURES), root / "exported",
                                nominal_checkpoint=True, ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "device", lr=LR)


def _values(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(path)).parameters}


def _examples(partition: int) -> int:
    return len(DATA(partition, DEVICES).train.dataset)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def fits(folders: tuple[TrainingArtifacts, TrainingArtifacts]) -> list[dict[str, np.ndarray]]:
    """Each device's plain update of round 1 by ORT's documented loop, from the export's values."""
    exported, device = folders
    start = _values(exported.checkpoint)
    return [ort_device_loop(device.directory, [list(b) for b in DATA(p, DEVICES).train], lr=None, graphs="ort",
                            values=start) for p in range(DEVICES)]


def drop(partition: int, stage: str, *, rounds: tuple[int, ...] = (1,)) -> Any:
    """A device mod: device `partition` raises at SecAgg+ stage `stage` of `rounds` (after sharing its keys)."""
    def mod(message: Message, context: Context, call_next: Any) -> Message:
        configs = message.content.config_records.get("secaggplus_configs")
        if (configs is not None and configs.get("stage") == stage and int(context.node_config["partition-id"])
                == partition and int(message.metadata.group_id) in rounds):
            raise RuntimeError(f"device {partition} leaves at {stage}")
        return call_next(message, context)

    return mod


def _fleet(folders: tuple[TrainingArtifacts, TrainingArtifacts], folder: Path, *, rounds: int = 1,
           mods: list[Any] | None = None, **options: Any) -> tuple[SecureFleetServer, Recorder]:
    exported, device = folders
    server = SecureFleetServer(GlobalModel(exported), rounds=rounds, directory=folder, devices=DEVICES,
                               secagg={**SECAGG, **options.pop("secagg", {})}, **options)
    client = DeviceClient(device.directory, DATA)
    grid = Recorder(LocalGrid(client.client_app(mods=[*(mods or []), *secure_mods()]), nodes=DEVICES))
    server.server_app()(grid, Context(1, 0, {}, RecordDict(), {}))
    return server, grid


def _assert_fedavg(written: Path, updates: list[dict[str, np.ndarray]], counts: list[int]) -> None:
    expected = fedavg(updates, counts)
    bound = secagg_bound(updates, counts, expected)
    got = _values(written)
    worst = max(np.max(np.abs(got[name].astype(np.float64) - expected[name])) for name in expected)
    assert 0 < worst <= bound, (worst, bound)  # through the quantization, within its bound


# ----------------------------------------------------------------------------- what the server sees
def test_the_server_receives_no_plain_update_and_aggregates_fedavg_within_the_bound(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], fits: list[dict[str, np.ndarray]], tmp_path: Path
) -> None:
    server, grid = _fleet(folders, tmp_path)
    counts = [_examples(p) for p in range(DEVICES)]
    _assert_fedavg(round_path(tmp_path, 1), fits, counts)
    assert [(r.devices, r.examples, r.halted) for r in server.history] == [(DEVICES, sum(counts), None)]

    for node, contents in grid.replies.items():
        update = fits[node - 1]
        blobs = [array.data for content in contents for record in content.array_records.values()
                 for array in record.values()]
        blobs += [item for content in contents for record in content.config_records.values()
                  for value in record.values() for item in (value if isinstance(value, list) else [value])
                  if isinstance(item, bytes)]
        assert len(contents) == 4
        assert blobs
        for tensor in update.values():
            assert all(tensor.astype(np.float32).tobytes() not in blob for blob in blobs)
        masked = [content.config_records["secaggplus_configs"][Key.MASKED_PARAMETERS] for content in contents
                  if Key.MASKED_PARAMETERS in content.config_records["secaggplus_configs"]]
        vector = np.concatenate([bytes_to_ndarray(b).ravel() for b in masked[0]])[1:].astype(np.float64)
        plain = np.concatenate([v.ravel() for v in update.values()])
        assert vector.shape == plain.shape
        assert abs(np.corrcoef(vector, plain)[0, 1]) < 0.1


def test_the_next_round_sends_the_float32_values_the_last_round_saved(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    server, grid = _fleet(folders, tmp_path, rounds=2)
    first, second = server.history
    (fit, *_) = [m.content for m in grid.sent if m.metadata.group_id == "2" and "fitins.parameters" in m.content]
    names = str(fit.config_records["fitins.config"][NAMES_KEY]).split("\n")
    arrays = fit.array_records["fitins.parameters"].values()
    sent = {name: bytes_to_ndarray(array.data) for name, array in zip(names, arrays, strict=True)}
    saved = _values(round_path(tmp_path, 1))
    assert all(value.dtype == np.float32 for value in sent.values())  # not SecAgg+'s float64 dequantized sum
    assert sorted(sent) == sorted(saved)
    assert all(np.array_equal(sent[name], saved[name]) for name in saved)
    assert first.sent_bytes == second.sent_bytes


# ----------------------------------------------------------------------------- devices that drop
@pytest.mark.parametrize(("stage", "contributors"), [("share_keys", [0, 2]), ("collect_masked_vectors", [0, 2]),
                                                     ("unmask", [0, 1, 2])],
                         ids=["at-share-keys", "at-collect-masked-vectors", "at-unmask"])
def test_a_device_that_leaves_after_sharing_its_keys_is_recovered_from_the_others_shares(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], fits: list[dict[str, np.ndarray]], tmp_path: Path,
    stage: str, contributors: list[int],
) -> None:
    server, _ = _fleet(folders, tmp_path, mods=[drop(1, stage)])
    (record,) = server.history
    assert record.halted is None
    assert list(record.failures) == [2]
    assert "device 1 leaves at " + stage in record.failures[2]
    _assert_fedavg(round_path(tmp_path, 1), [fits[p] for p in contributors], [_examples(p) for p in contributors])


def test_below_the_threshold_a_round_fails_in_one_line_writes_nothing_and_the_next_round_runs(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], fits: list[dict[str, np.ndarray]], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server, _ = _fleet(folders, tmp_path, rounds=2, mods=[drop(0, "collect_masked_vectors"),
                                                           drop(1, "collect_masked_vectors")])
    first, second = server.history
    why = ("secure aggregation stopped at its collect masked vectors stage: 1 of 3 devices still answered, below "
           "the reconstruction threshold of 2 shares; no aggregate this round, and the next one starts from the same "
           "values")
    assert first.halted == why
    config = FleetConfig.from_dict({"devices": {"count": DEVICES}, "secagg": {"enabled": True},
                                    "output": {"folder": str(tmp_path / "out"), "plot": False}})
    history = report(server, config, 1.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("3 devices, iid split, fedavg, SecAgg+")
    assert f"          no aggregate: {why}" in lines
    assert [r["halted"] for r in history["rounds"]] == [why, None]
    assert first.checkpoint is None
    assert not round_path(tmp_path, 1).exists()
    assert second.halted is None
    assert second.checkpoint == round_path(tmp_path, 2)
    # Round 2 started from the export's values again: its aggregate is round 1's FedAvg of the three.
    _assert_fedavg(round_path(tmp_path, 2), fits, [_examples(p) for p in range(DEVICES)])


# ----------------------------------------------------------------------------- with the rest of the fleet
@pytest.mark.parametrize(("clipping", "key"), [("fixed", "clipping_norm"), ("adaptive", "initial_clipping_norm")])
def test_client_side_clipping_composes_the_devices_clip_before_they_mask(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], fits: list[dict[str, np.ndarray]], tmp_path: Path,
    clipping: str, key: str,
) -> None:
    norm = 0.05
    server, _ = _fleet(folders, tmp_path, privacy={"side": "client", "clipping": clipping, key: norm,
                                                   "noise_multiplier": 0.0})
    start = {name: value.astype(np.float64) for name, value in _values(folders[0].checkpoint).items()}
    clipped = []
    for update in fits:
        delta = {name: update[name] - start[name] for name in update}
        size = np.sqrt(sum(float(np.sum(d**2)) for d in delta.values()))
        assert size > norm  # the clipping bites
        clipped.append({name: start[name] + d * (norm / size) for name, d in delta.items()})
    _assert_fedavg(round_path(tmp_path, 1), clipped, [_examples(p) for p in range(DEVICES)])
    assert server.history[0].train_metrics["norm_bit"] == 1  # every device's update was above the norm


@pytest.mark.parametrize("name", ROBUST)
def test_strategies_that_need_each_update_are_refused_in_one_line(name: str) -> None:
    with pytest.raises(ConfigurationError, match=f"Strategy {name} cannot run with `secagg.enabled: true`: it needs "
                       "each device's own update"):
        FleetConfig.from_dict({"strategy": {"name": name}, "secagg": {"enabled": True}})


@pytest.mark.parametrize(("values", "message"), [
    ({"strategy": {"name": "fedadam"}}, "Expected `strategy.name: fedavg` with `secagg.enabled: true`"),
    ({"privacy": {"side": "server"}}, "server-side clipping clips each device's update"),
])
def test_what_secure_aggregation_cannot_serve_is_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        FleetConfig.from_dict({**values, "secagg": {"enabled": True}})


def test_flowers_refusal_of_the_secagg_section_is_told_in_one_line(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match="Flower's SecAggPlusWorkflow refused the secagg section: "
                       "`modulus_range` must be a power of 2"):
        SecureFleetServer(GlobalModel(folders[0]), rounds=1, directory=tmp_path, devices=3,
                          secagg={**SECAGG, "modulus_range": 3 * 2**22})


def test_the_config_turns_it_on_and_the_run_keeps_its_files_and_history(tmp_path: Path) -> None:
    from ort_lightning.fleet.run import run_fleet

    history = run_fleet({"rounds": 1, "devices": {"count": 3}, "model": {"hidden": 8, "verify": False},
                         "secagg": {"enabled": True}, "output": {"folder": str(tmp_path), "plot": False}}, echo=False)
    (record,) = history["rounds"]
    assert record["devices"] == 3
    assert record["halted"] is None
    assert 0 <= record["accuracy"] <= 1
    assert Path(record["checkpoint"]) == round_path(tmp_path / "rounds", 1)
    assert (tmp_path / "rounds" / "last.ortckpt").exists()
    assert history["initial"]["accuracy"] != record["accuracy"]


def test_federated_lora_composes_only_the_adapters_are_masked_and_the_base_stays(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft", reason='peft is not installed: pip install -e ".[test]"')
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], init_lora_weights="gaussian")
    model = peft.get_peft_model(digits_mlp(16, seed=0), config)
    exported = export_artifacts(model, torch.zeros(2, FEATURES), tmp_path / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    device = prepare_for_web(exported, tmp_path / "device", lr=LR)
    adapters, frozen = list(exported.manifest.trainable), list(exported.manifest.frozen)
    assert list(GlobalModel(exported).arrays()) == adapters  # what travels, and so what is masked

    server, grid = _fleet((exported, device), tmp_path / "rounds")
    start = _values(exported.checkpoint)
    fits = [ort_device_loop(device.directory, [list(b) for b in DATA(p, DEVICES).train], lr=None, graphs="ort",
                            checkpoint=device.checkpoint, values=start) for p in range(DEVICES)]
    updates = [{name: fit[name] for name in adapters} for fit in fits]
    _assert_fedavg(round_path(tmp_path / "rounds", 1), updates, [_examples(p) for p in range(DEVICES)])
    written = _values(round_path(tmp_path / "rounds", 1))
    assert all(written[name].tobytes() == start[name].tobytes() for name in frozen)
    size = sum(start[name].size for name in adapters)
    for contents in grid.replies.values():
        (masked,) = [c.config_records["secaggplus_configs"][Key.MASKED_PARAMETERS] for c in contents
                     if Key.MASKED_PARAMETERS in c.config_records["secaggplus_configs"]]
        assert sum(bytes_to_ndarray(b).size for b in masked) == 1 + size  # the weight, then the adapters alone
    assert server.history[0].devices == DEVICES


@pytest.mark.slow
@pytest.mark.alone  # Ray
def test_flowers_ray_simulation_runs_the_secure_round(tmp_path: Path) -> None:
    from ort_lightning.fleet.run import run_fleet

    history = run_fleet({"rounds": 1, "devices": {"count": 3}, "model": {"hidden": 8, "verify": False},
                         "engine": {"name": "ray"}, "secagg": {"enabled": True},
                         "output": {"folder": str(tmp_path), "plot": False}}, echo=False)
    (record,) = history["rounds"]
    assert record["devices"] == 3
    assert record["halted"] is None
    assert record["failures"] == {}
    assert Path(record["checkpoint"]) == round_path(tmp_path / "rounds", 1)

