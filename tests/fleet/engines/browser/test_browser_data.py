"""Browser fleet pages that make their own data, and the one order of the flat weights.

The pages of these fleets import ``examples/browser_data.js`` and train the batches it makes; the
server sends weights only. The reference rebuilds the same batches in Python from the module's
formula (mulberry32, seed 1000 + partition), trains each device's round in ONNX Runtime's
documented Python loop on the device files, and averages by example count in float64. The model's
layers are named so that neither the alphabetical order nor the manifest's ``parameter_order``
(BatchNorm's running statistics last) is the order of ONNX Runtime's parameter buffer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.errors import ConfigurationError, DeviceReplyError
from tests._web import ROOT, ort_web_dist
from tests.helpers import RunIf, ort_device_loop

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from ort_lightning.fleet import BrowserFleet  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions  # noqa: E402
from ort_lightning.fleet.devices.frames import pack, read_result, unpack  # noqa: E402
from ort_lightning.fleet.devices.weight_order import check_buffer_order  # noqa: E402
from tests.fleet.engines.browser.chromium import chromium  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import assert_round, fedavg_server  # noqa: E402

pytestmark = pytest.mark.slow

CDN = "https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist"  # returned as given, never fetched
LR = 0.05
DATA_MODULE = ROOT / "examples" / "browser_data.js"
FEATURES, BATCH_SIZE, DIRECTION = 4, 8, (1.0, -2.0, 0.5, 1.5)
_MASK = 0xFFFFFFFF


class Unsorted(torch.nn.Module):
    """Layers named so that their alphabetical order is not the graph's; a BatchNorm; a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        self.zeta = torch.nn.Linear(FEATURES, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.alpha = torch.nn.Linear(8, 2)
        self.zeta.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha(torch.relu(self.norm(self.zeta(x))))


@pytest.fixture(scope="session")
def unsorted_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The model exported once (the server's folder) and its web-prepared device folder (lr 0.05, constant)."""
    from ort_lightning.export import prepare_for_web

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("browser-data")
    exported = export_artifacts(Unsorted(), torch.zeros(2, FEATURES), root / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "web", lr=LR)


# ----------------------------------------------------------------------------- the module's data, in Python
def _mulberry32(seed: int) -> list[float]:
    """An endless list is not needed: the draws of mulberry32 (examples/browser_data.js), 4 per example."""
    state, draws = seed & _MASK, []
    for _ in range(4 * 64):
        state = (state + 0x6D2B79F5) & _MASK
        t = ((state ^ (state >> 15)) * (state | 1)) & _MASK
        t ^= (t + ((t ^ (t >> 7)) * (t | 61))) & _MASK
        draws.append(((t ^ (t >> 14)) & _MASK) / 4294967296)
    return draws


def _examples(partition: int) -> tuple[np.ndarray, np.ndarray]:
    count = 24 + 8 * partition
    draws = iter(_mulberry32(1000 + partition))
    x = np.array([[2 * next(draws) - 1 for _ in range(FEATURES)] for _ in range(count)], dtype=np.float32)
    # NOTE: as the module does: the float32 values, summed left to right in float64.
    scores = [sum(float(v) * d for v, d in zip(row, DIRECTION, strict=True)) for row in x]
    return x, np.array([1 if score > 0 else 0 for score in scores], dtype=np.int64)


def _batches(partition: int) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = _examples(partition)
    return [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, len(y), BATCH_SIZE)]


# ----------------------------------------------------------------------------- the reference
def _values(path: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in CheckpointState.load_checkpoint(str(path)).parameters}


# ----------------------------------------------------------------------------- the tests
def test_the_python_replica_makes_the_modules_first_values() -> None:
    # Printed by Node from examples/browser_data.js (partition 1, first row, and its first batch's labels).
    x, y = _examples(1)
    np.testing.assert_array_equal(x[0], np.array([-0.7176500558853149, -0.4651927947998047, -0.7778074741363525,
                                                  -0.3342112898826599], np.float32))
    assert y[:8].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]


@RunIf(chromium=True)
def test_pages_train_their_own_data_as_onnx_runtimes_loop_does(
    unsorted_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = unsorted_folders
    fleet = BrowserFleet(web, page_data=DATA_MODULE, max_examples=40, port=0, devices=2, device_timeout=60,
                         ort_web=ort_web_dist())
    with fleet, chromium({n: f"{fleet.url}&name={n}" for n in ("a", "b")}):
        server = fleet.run(fedavg_server(exported, tmp_path, devices=2, rounds=1), join_timeout=90)
    assert fleet.refusals == []
    [record] = server.history
    assert record.devices == 2
    start = _values(exported.checkpoint)
    fits = [(ort_device_loop(web.directory, _batches(p), lr=LR, graphs="ort", values=start), 24 + 8 * p)
            for p in (0, 1)]
    expected = {name: sum(values[name].astype(np.float64) * count for values, count in fits) / 56 for name in start}
    assert_round(record.checkpoint, expected)


def test_the_flat_weights_follow_onnx_runtimes_buffer_not_the_manifest_nor_the_alphabet(
    unsorted_folders: tuple[TrainingArtifacts, TrainingArtifacts],
) -> None:
    exported, web = unsorted_folders
    with BrowserFleet(web, page_data=DATA_MODULE, max_examples=40, port=0, devices=1, ort_web=CDN) as fleet:
        declared, exchange = fleet.exchange.full.names, fleet.exchange
    # ONNX Runtime's own buffer over the complete checkpoint, cut at each tensor's size in the declared order
    state = CheckpointState.load_checkpoint(str(exported.checkpoint))
    module = Module(str(exported.training_model), state, str(exported.eval_model))
    flat, at = module.get_contiguous_parameters(trainable_only=False).numpy(), 0
    for name in declared:
        value = np.array(state.parameters[name].data).ravel()
        np.testing.assert_array_equal(flat[at : at + value.size], value, err_msg=name)
        at += value.size
    assert at == flat.size
    # a round carries every tensor but the frozen bias (the BatchNorm statistics too), cut out of that buffer
    assert fleet.hub.weight_order.names == [name for name in declared if name != "zeta.bias"]
    assert exchange.mode == "spans"
    np.testing.assert_array_equal(exchange.gather(flat), np.concatenate(
        [np.array(state.parameters[name].data).ravel() for name in fleet.hub.weight_order.names]))
    assert declared != sorted(declared)
    assert declared != list(web.manifest.parameter_order)
    with pytest.raises(ConfigurationError, match=r"The browser fleet declares its flat weights in the order "
                                                 r"\['alpha.bias'.*but ONNX Runtime's parameter buffer over "
                                                 r"training_model.ort and nominal_checkpoint holds \['zeta.weight'.*"
                                                 r"Give the fleet the training graph and checkpoint of one export"):
        check_buffer_order(sorted(declared), web.directory / "training_model.ort", web.directory / "nominal_checkpoint")


def test_page_data_options_are_checked(unsorted_folders: tuple[TrainingArtifacts, TrainingArtifacts],
                                       tmp_path: Path) -> None:
    _, web = unsorted_folders
    with pytest.raises(ConfigurationError, match=r"Expected exactly one of `data` .* and `page_data` .*, but got "
                                                 r"both; pass one of them"):
        BrowserFleet(web, DigitsPartitions(), page_data=DATA_MODULE, max_examples=40, ort_web=CDN)
    with pytest.raises(ConfigurationError, match=r"but got neither; pass one of them"):
        BrowserFleet(web, ort_web=CDN)
    with pytest.raises(ConfigurationError, match=r"Expected `page_data` to be an ES module file \(.js or .mjs\) that "
                                                 r"exports `batches`, but got '.*data.py', which is not such a file"):
        BrowserFleet(web, page_data=tmp_path / "data.py", max_examples=40, ort_web=CDN)
    with pytest.raises(ConfigurationError, match=r"Expected `max_examples` >= 1 with `page_data`, but got None: the "
                                                 r"server cannot count what a page makes"):
        BrowserFleet(web, page_data=DATA_MODULE, ort_web=CDN)


def test_a_claim_over_max_examples_is_refused_with_the_stated_bound() -> None:
    frame = pack({"type": "result", "id": "m", "examples": 41, "steps": 1, "losses": [0.5]}, [np.zeros(3, np.float32)])
    with pytest.raises(DeviceReplyError, match=r"d claims 41 examples per epoch from its own data, but the fleet "
                                               r"allows 1 to 40 \(max_examples=40\); the device is refused"):
        read_result(*unpack(frame), device="d", parameters=3, given=40, stated=True)


def test_page_data_in_a_fleet_config_needs_browsers() -> None:
    from ort_lightning.fleet.run import FleetConfig

    config = FleetConfig.from_dict({"engine": {"name": "browser", "page_data": str(DATA_MODULE), "max_examples": 40}})
    assert (config.engine.page_data, config.engine.max_examples) == (str(DATA_MODULE), 40)
    with pytest.raises(ConfigurationError, match=r"Expected `engine.name: browser` with `engine.page_data`, but got "
                                                 r"engine 'local': only browser pages import a data module"):
        FleetConfig.from_dict({"engine": {"page_data": str(DATA_MODULE), "max_examples": 40}})
