"""Every strategy of Flower's Message API from the config's sections, one round each on a small in-process fleet.

The devices run ONNX Runtime's device loop (`DeviceClient`) on a tiny MLP. A recording mod keeps
each device's raw reply; the references are computed here with numpy and scipy from those
replies, never through the fleet's code: a poisoned device (its reply's weights times 1e3) is
outvoted by FedMedian, FedTrimmedAvg, Krum, MultiKrum and Bulyan (every global weight stays
within the honest replies' range, and equals numpy's median, scipy's trimmed mean, one honest
reply or the honest replies' weighted mean where the rule says so) and not by FedAvg; with the
noise off, each DP wrapper's round equals the weighted mean of the updates clipped to its norm
(the devices clip where a client-side wrapper asks: `clip_when_asked`, a browser's ``device.js``).
"""

from __future__ import annotations

import gc
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.errors import ConfigurationError, DeviceReplyError
from ort_lightning.export import prepare_for_web
from tests._web import NODE_DEVICE, ROOT, ort_web_dist, run_beside_node
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Array, ArrayRecord, Context, Message, MessageType  # noqa: E402
from scipy.stats import trim_mean  # noqa: E402

from ort_lightning.fleet import ClientData, DeviceClient, FleetServer, GlobalModel, run_local  # noqa: E402
from ort_lightning.fleet.devices.frames import Result  # noqa: E402
from ort_lightning.fleet.devices.weight_order import WeightOrder  # noqa: E402
from ort_lightning.fleet.engines.browser.reply import reply_records  # noqa: E402
from ort_lightning.fleet.server.strategies import PRIVACY, STRATEGIES, strategy_from  # noqa: E402

LR = 0.05
#: Examples per device: unequal, so that weighting by example count matters.
SIZES = (12, 16, 20, 12, 16, 20, 24)
Values = dict[str, np.ndarray]


def _data(partition: int, partitions: int) -> ClientData:
    generator = torch.Generator().manual_seed(partition)
    labels = torch.randint(0, 3, (SIZES[partition],), generator=generator)
    x = torch.eye(3, 4)[labels] * 3 + 0.5 * torch.randn(len(labels), 4, generator=generator)
    return ClientData(train=DataLoader(TensorDataset(x, labels), batch_size=8))


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> Iterator[None]:
    """Keep the test process's heap out of the full collections Flower's ArrayRecord runs per reply (Bulyan, QFedAvg).

    ``ArrayRecord.to_numpy_ndarrays(keep_input=False)`` calls ``gc.collect()``; in a process that holds
    pytest, torch and Lightning, each took about a second on a 2-core machine.
    """
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The server's artifacts and the devices' folder (``prepare_for_web``: its graph trains at `LR`)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    root = tmp_path_factory.mktemp("strategies")
    exported = export_artifacts(model, torch.zeros(2, 4), root / "mlp", nominal_checkpoint=True, ort_format=True,
                                verify=False)
    return exported, prepare_for_web(exported, root / "web", lr=LR)


def _numpy(record: ArrayRecord) -> Values:
    return {name: np.array(array.numpy(), dtype=np.float32) for name, array in record.items()}


def _record(replies: dict[int, tuple[Values, int]]) -> Callable[..., Message]:
    """A mod that keeps each device's raw train reply (its values and examples) by partition."""

    def mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        reply = call_next(message, context)
        if message.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            examples = int(reply.content.metric_records["metrics"]["num-examples"])  # type: ignore[arg-type]
            values = _numpy(reply.content.array_records["arrays"])
            replies[int(context.node_config["partition-id"])] = (values, examples)
        return reply

    return mod


def _poison(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Partition 0 answers with its trained weights times 1e3."""
    reply = call_next(message, context)
    if context.node_config["partition-id"] == 0 and not reply.has_error():
        arrays = reply.content.array_records["arrays"]
        reply.content["arrays"] = ArrayRecord({k: Array(v.numpy() * np.float32(1e3)) for k, v in arrays.items()})
    return reply


def _round(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], strategy: Any, folder: Path, *, devices: int,
    mods: list[Any] | None = None,
) -> tuple[Values, Values, dict[int, tuple[Values, int]], FleetServer]:
    """One round of `strategy` over `devices` devices: (start, global after it, raw replies by partition, server).

    The devices' ClientApp clips where a client-side DP wrapper asks (its first mod), then runs `mods`; the
    recording mod, innermost, sees each device's raw reply.
    """
    replies: dict[int, tuple[Values, int]] = {}
    exported, web = folders
    model = GlobalModel(exported)
    start = _numpy(model.arrays())
    server = FleetServer(model, strategy, rounds=1, directory=folder)
    client = DeviceClient(web.directory, _data)
    run_local(server.server_app(), client.client_app(mods=[*(mods or []), _record(replies)]), nodes=devices)
    assert [(record.devices, record.checkpoint is not None) for record in server.history] == [(devices, True)]
    return start, _numpy(model.arrays()), replies, server


def _stack(replies: list[Values], name: str) -> np.ndarray:
    return np.stack([reply[name] for reply in replies])


def _distance(a: Values, b: Values) -> float:
    return math.sqrt(sum(float(((a[n].astype(np.float64) - b[n]) ** 2).sum()) for n in a))


# ----------------------------------------------------------------------------- every strategy runs
@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - {"fedmedian", "fedtrimmedavg", "krum", "multikrum",
                                                           "bulyan"}))
def test_each_fedavg_variant_runs_a_round_from_its_name(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, name: str
) -> None:
    strategy = strategy_from({"name": name, "options": {}}, None, 3, lr=LR)
    start, end, replies, _ = _round(folders, strategy, tmp_path, devices=3)
    assert sorted(replies) == [0, 1, 2]
    assert all(np.isfinite(value).all() for value in end.values())
    assert _distance(start, end) > 1e-3


# ----------------------------------------------------------------------------- a poisoned device
def _within_honest_range(end: Values, honest: list[Values]) -> None:
    for name, value in end.items():
        stacked = _stack(honest, name)
        assert np.all(value >= stacked.min(axis=0) - 1e-6), name
        assert np.all(value <= stacked.max(axis=0) + 1e-6), name


def _weighted_mean(replies: list[tuple[Values, int]]) -> Values:
    weights = np.array([examples for _, examples in replies], dtype=np.float64)
    return {n: np.tensordot(weights / weights.sum(), np.stack([v[n] for v, _ in replies]).astype(np.float64), 1)
            for n in replies[0][0]}


ROBUST = {
    "fedmedian": {},
    "fedtrimmedavg": {"beta": 0.2},
    "krum": {"num_malicious_nodes": 1},
    "multikrum": {"num_malicious_nodes": 1},
    "bulyan": {"num_malicious_nodes": 1},
}


@pytest.mark.parametrize("name", [*ROBUST, "fedavg"])
def test_a_poisoned_device_is_outvoted_by_the_robust_strategies_and_not_by_fedavg(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, name: str
) -> None:
    devices = len(SIZES)  # Bulyan with one Byzantine device needs 4f+3 = 7
    strategy = strategy_from({"name": name, "options": ROBUST.get(name, {})}, None, devices)
    _, end, replies, _ = _round(folders, strategy, tmp_path, devices=devices, mods=[_poison])
    honest = [replies[p][0] for p in range(1, devices)]
    sent = [{n: v * np.float32(1e3) for n, v in replies[0][0].items()}, *honest]
    largest = max(float(np.abs(v).max()) for reply in honest for v in reply.values())
    if name == "fedavg":
        assert max(float(np.abs(v).max()) for v in end.values()) > 50 * largest
        return
    _within_honest_range(end, honest)
    for n, value in end.items():
        if name == "fedmedian":
            np.testing.assert_allclose(value, np.median(_stack(sent, n), axis=0), rtol=1e-6, atol=1e-7)
        elif name == "fedtrimmedavg":
            np.testing.assert_allclose(value, trim_mean(_stack(sent, n), 0.2, axis=0), rtol=1e-6, atol=1e-7)
    if name == "krum":
        assert any(_distance(end, reply) == 0.0 for reply in honest)
    elif name == "multikrum":  # the n - f best: the six honest replies, by their examples
        mean = _weighted_mean([replies[p] for p in range(1, devices)])
        assert _distance(end, mean) < 1e-5
    elif name == "bulyan":
        mean = _weighted_mean([replies[p] for p in range(1, devices)])
        assert _distance(end, mean) <= max(_distance(reply, mean) for reply in honest)


# ----------------------------------------------------------------------------- differential privacy
NORM = 0.05


def _clipped_mean(start: Values, replies: list[tuple[Values, int]], norm: float) -> Values:
    """The examples-weighted mean of start + each update scaled to at most `norm` (Flower's flat clipping)."""
    clipped = []
    for values, examples in replies:
        scale = min(1.0, norm / _distance(values, start))
        clipped.append(({n: start[n] + (values[n].astype(np.float64) - start[n]) * scale for n in start}, examples))
    return _weighted_mean(clipped)


@pytest.mark.parametrize("clipping", ["fixed", "adaptive"])
@pytest.mark.parametrize("side", ["client", "server"])
def test_each_dp_wrapper_clips_the_updates_to_its_norm(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, side: str, clipping: str
) -> None:
    norm = {"clipping_norm": NORM} if clipping == "fixed" else {"initial_clipping_norm": NORM}
    privacy = {"side": side, "clipping": clipping, "noise_multiplier": 0.0, **norm}
    strategy = strategy_from({"name": "fedavg", "options": {}}, privacy, 3)
    start, end, replies, _ = _round(folders, strategy, tmp_path, devices=3)
    raw = [replies[p] for p in range(3)]
    above = sum(_distance(values, start) > NORM for values, _ in raw)
    assert above >= 1  # some update is clipped, so the check below can fail
    assert _distance(end, _clipped_mean(start, raw, NORM)) < 1e-5
    assert _distance(end, start) <= NORM * (1 + 1e-5)
    if clipping == "adaptive":  # the next norm follows the fraction clipped (noise off): Andrew et al.'s update
        assert strategy.clipping_norm == pytest.approx(NORM * math.exp(-0.2 * (above / 3 - 0.5)), rel=1e-9)


# ----------------------------------------------------------------------------- the defaults are quiet
def test_the_defaults_build_every_strategy_without_a_flower_warning() -> None:
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        built = [strategy_from({"name": name}, None, 7, lr=LR) for name in STRATEGIES]
        built += [strategy_from({"name": "fedavg"}, {"side": side, "clipping": "fixed", "noise_multiplier": 1.0,
                                                     "clipping_norm": 1.0}, 7) for side in ("client", "server")]
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in warnings] == []
    assert all(getattr(s, "fraction_evaluate", 0.0) == 0.0 for s in built[: len(STRATEGIES)])
    assert built[STRATEGIES.__len__() - 1].min_train_nodes == 7  # bulyan waits for its 4f+3


@pytest.mark.parametrize(("name", "devices", "min_nodes", "waits"),
                         [("fedavg", 1, None, 1), ("fedavg", 10, None, 2), ("fedavg", 10, 9, 9), ("krum", 5, 4, 5),
                          ("bulyan", 10, None, 7)])
def test_each_round_waits_for_the_devices_the_strategy_and_the_engine_need(
    name: str, devices: int, min_nodes: int | None, waits: int
) -> None:
    strategy = strategy_from({"name": name}, None, devices, min_nodes=min_nodes)  # a deployment: devices - 1
    assert (strategy.min_available_nodes, strategy.min_train_nodes) == (waits, waits)


# ----------------------------------------------------------------------------- the docs' tables
#: What every strategy starts from (the docs say it once, above the table).
COMMON = {"fraction_evaluate", "min_evaluate_nodes", "min_available_nodes", "min_train_nodes"}


def test_the_docs_tables_name_every_strategy_and_what_the_fleet_sets_beyond_flower() -> None:
    text = (ROOT / "docs" / "fleets.md").read_text(encoding="utf-8")
    table = {name: (kind, column) for name, kind, column in re.findall(r"^\| `(\w+)` \| `(\w+)` \| ([^|]*) \|", text,
                                                                       re.MULTILINE)}
    assert sorted(table) == sorted(STRATEGIES)
    for name, kind in STRATEGIES.items():
        documented, column = table[name]
        assert documented == kind.__name__
        built = strategy_from({"name": name}, None, 10, lr=LR)
        parameters = inspect.signature(kind.__init__).parameters.values()
        changed = {p.name for p in parameters if hasattr(built, p.name) and not callable(getattr(built, p.name))
                   and (p.default is inspect.Parameter.empty or getattr(built, p.name) != p.default)} - COMMON
        assert all(f"`{key}" in column for key in changed), (name, changed, column)
        assert bool(changed) != column.startswith("none"), (name, changed, column)
    wrappers = re.findall(r"^\| `(\w+)` / `(\w+)` \| `(\w+)` \|", text, re.MULTILINE)
    assert {(side, clipping): kind for side, clipping, kind in wrappers} == {k: v.__name__ for k, v in PRIVACY.items()}


# ----------------------------------------------------------------------------- what cannot work is refused
FIXED = {"side": "server", "clipping": "fixed", "noise_multiplier": 1.0, "clipping_norm": 1.0}


@pytest.mark.parametrize(
    ("strategy", "privacy", "devices", "message"),
    [
        ({"name": "fedsgd"}, None, 3, r"Unknown strategy name 'fedsgd'; choose one of \['bulyan', "),
        ({"name": "fedavg", "eta": 0.1}, None, 3,
         r"Unknown key\(s\) \['eta'\] in the strategy section; it takes `name`"),
        ({"name": "fedavg", "options": {"eta": 0.1}}, None, 3,
         r"Unknown option `eta` for strategy fedavg \(Flower's FedAvg\); its options are \['fraction_evaluate'"),
        ({"name": "fedadam", "options": {"eta": "fast"}}, None, 3,
         r"Expected option `eta` of strategy fedadam to be float, but got 'fast'"),
        ({"name": "bulyan"}, None, 6, r"bulyan with num_malicious_nodes=1 needs at least 4f\+3 = 7 devices, but the "
                                      r"fleet has 6"),
        ({"name": "krum", "options": {"num_malicious_nodes": 2}}, None, 6,
         r"krum with num_malicious_nodes=2 needs at least 2f\+3 = 7 devices"),
        ({"name": "multikrum", "options": {"num_nodes_to_select": 5}}, None, 5,
         r"multikrum selects num_nodes_to_select=5 replies, but between 1 and devices - f = 4"),
        ({"name": "krum", "options": {"min_train_nodes": 3}}, None, 5,
         r"aggregates 5 replies or more, but min_train_nodes is 3"),
        ({"name": "fedavg", "options": {"min_train_nodes": 4}}, None, 3,
         r"`min_train_nodes` of strategy fedavg is 4, above the fleet's 3 devices: every round would wait for ever"),
        ({"name": "fedprox", "options": {"proximal_mu": 0.1}}, None, 3,
         r"fedprox with proximal_mu=0.1 needs devices that add the proximal term"),
        ({"name": "qfedavg"}, None, 3, r"qfedavg needs `client_learning_rate`"),
        ({"name": "fedtrimmedavg"}, None, 4, r"beta=0.2 over 4 devices cuts int\(0.2 \* 4\) = 0 replies"),
        ({"name": "fedtrimmedavg", "options": {"beta": 0.6}}, None, 4,
         r"Flower's FedTrimmedAvg refused the strategy fedtrimmedavg options: `beta` must be in the range"),
        ({"name": "fedavg"}, {"side": "both"}, 3, r"Unknown privacy side/clipping \('both', 'fixed'\); choose one of"),
        ({"name": "fedavg"}, {"side": "server", "clipping": "fixed"}, 3,
         r"The privacy server/fixed section needs \['noise_multiplier', 'clipping_norm'\]"),
        ({"name": "fedavg"}, {**FIXED, "clip": 2.0}, 3, r"Unknown option `clip` for privacy server/fixed"),
        ({"name": "fedavg"}, {**FIXED, "num_sampled_clients": 4}, 3,
         r"num_sampled_clients=4 is not between 1 and the fleet's 3 devices"),
        ({"name": "fedavg"}, {"side": "server", "clipping": "adaptive", "noise_multiplier": 1.0}, 5,
         r"Flower's DifferentialPrivacyServerSideAdaptiveClipping refused the privacy server/adaptive options: "
         r"If not specified, `clipped_count_stddev`"),
    ],
    ids=["unknown-name", "section-key", "unknown-option", "option-type", "bulyan-devices", "krum-devices",
         "multikrum-selection", "krum-min-nodes", "min-nodes-above-devices", "fedprox-mu", "qfedavg-lr",
         "trimmed-nothing", "flower-refusal", "privacy-side", "privacy-required", "privacy-option",
         "sampled-above-devices", "adaptive-noise"],
)
def test_what_cannot_work_is_refused_in_one_line(
    strategy: dict[str, Any], privacy: dict[str, Any] | None, devices: int, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as raised:
        strategy_from(strategy, privacy, devices)
    assert "\n" not in str(raised.value)


# ----------------------------------------------------------------------------- browsers included
@pytest.mark.parametrize(("update_norm", "norm_bit"), [(0.5, 1), (0.05, 0)])
def test_a_browser_reply_carries_flowers_norm_bit_from_the_norm_the_device_clipped(
    update_norm: float, norm_bit: int
) -> None:
    result = Result(np.zeros(3, np.float32), examples=4, steps=1, losses=[0.5])
    header = {"seconds": 0.1, "update_norm": update_norm}
    _, metrics = reply_records(result, header, WeightOrder([("w", (3,))]), last_epoch=1, clip=0.1)
    assert metrics["norm_bit"] == norm_bit
    _, plain = reply_records(result, header, WeightOrder([("w", (3,))]), last_epoch=1)
    assert "norm_bit" not in plain


def test_a_browser_asked_to_clip_that_sends_no_norm_is_refused() -> None:
    result = Result(np.zeros(3, np.float32), examples=4, steps=1, losses=[0.5])
    with pytest.raises(DeviceReplyError, match=r"laptop was asked to clip its update to norm 0.1 but sent "
                                               r"update_norm=None, not the norm it clipped; the device is refused"):
        reply_records(result, {"seconds": 0.1}, WeightOrder([("w", (3,))]), last_epoch=1, clip=0.1, device="laptop")


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_node_devices_run_multikrum_under_client_side_adaptive_clipping(
    folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    from ort_lightning.fleet.engines.browser import BrowserFleet

    exported, web = folders
    privacy = {"side": "client", "clipping": "adaptive", "noise_multiplier": 0.0, "initial_clipping_norm": NORM}
    strategy = strategy_from({"name": "multikrum", "options": {"num_malicious_nodes": 0}}, privacy, 3)
    model = GlobalModel(exported)
    start = _numpy(model.arrays())
    server = FleetServer(model, strategy, rounds=1, directory=tmp_path / "rounds")
    with BrowserFleet(web, _data, port=0, devices=3, device_timeout=60, ort_web=ort_web_dist()) as fleet:
        run_beside_node(fleet, server, NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--devices", 3)
    assert [record.devices for record in server.history] == [3]
    assert 0 < _distance(_numpy(model.arrays()), start) <= NORM * (1 + 1e-5)
    # NOTE: Flower's wrapper refuses a round whose replies lack norm_bit; the next norm counts the clipped ones.
    assert any(strategy.clipping_norm == pytest.approx(NORM * math.exp(-0.2 * (k / 3 - 0.5))) for k in (1, 2, 3))
