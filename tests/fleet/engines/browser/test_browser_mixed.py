"""A SecAgg+ round over Python, Node and Chromium devices in one fleet: none sends its update, the sum is FedAvg's.

The fleet: two Python devices (`DeviceClient` with `secure_mods` in a `LocalGrid` of node ids 2**60 + 1 and
2**60 + 2, beyond what a page's JSON holds exactly, so that SecAgg+'s records carry them as ``{"int": digits}``)
train partitions 0 and 1 of 2 of the digits split by label; the Node device and the Chromium page, the
`BrowserFleet`'s 2 devices, train the partition of 2 of the IID split that the fleet gave each. The transport is
recorded twice: every reply the joined grid hands Flower's workflow, and every frame a page sends. The reference
is ONNX Runtime's documented loop per partition (``tests.helpers.ort_device_loop``), averaged here in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import NODE_DEVICE, node_beside, ort_web_dist
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from ort_lightning.fleet import BrowserFleet, DeviceClient, GlobalModel, LocalGrid, round_path  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions  # noqa: E402
from ort_lightning.fleet.devices.frames import decode_record, unpack  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer, secure_mods  # noqa: E402
from tests.fleet.engines.browser.chromium import chromium  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    LR,
    checkpoint_values,
    initial_values,
)
from tests.fleet.recorder import Recorder  # noqa: E402
from tests.fleet.secure_bound import fedavg, secagg_bound  # noqa: E402

SIMULATED = DigitsPartitions(split="label", batch_size=32, seed=0)
FIRST = 2**60 + 1
SECAGG = {"num_shares": 4, "reconstruction_threshold": 3}


class RecordedServer(SecureFleetServer):
    """The fleet's secure server, its grid recorded (`Recorder`)."""

    transport: Recorder

    def main(self, grid: Grid, context: Context) -> None:
        self.transport = Recorder(grid)
        super().main(self.transport, context)


def _masked(record: dict[str, Any]) -> np.ndarray:
    """The masked vectors of a collect stage's record, less the weight's, as one float64 vector."""
    return np.concatenate([bytes_to_ndarray(b).ravel() for b in record[Key.MASKED_PARAMETERS]])[1:].astype(np.float64)


def _assert_hidden(vector: np.ndarray, update: dict[str, np.ndarray]) -> None:
    """`vector` uncorrelated with `update`: |Pearson r| below 6 / sqrt(n), which chance passes once in 10**9.

    A plain update correlates near 1; at 1210 values the bound is 0.17 (0.1, 3.5 sigma, fails once in 2000 masks).
    """
    plain = np.concatenate([value.ravel() for value in update.values()]).astype(np.float64)
    assert vector.shape == plain.shape
    assert abs(np.corrcoef(vector, plain)[0, 1]) < 6 / np.sqrt(plain.size)


def _references(folder: Path, start: dict[str, np.ndarray], partitions: dict[int, tuple[DigitsPartitions, int]]
                ) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, int]]:
    """Per node, its round from `start` by ONNX Runtime's documented loop, and its example count."""
    updates, counts = {}, {}
    for node_id, (data, partition) in partitions.items():
        loader = data(partition, 2).train
        updates[node_id] = ort_device_loop(folder, [list(b) for b in loader], lr=LR, graphs="ort", values=start)
        counts[node_id] = len(loader.dataset)  # type: ignore[arg-type]
    return updates, counts


def _assert_fedavg(written: Path | None, updates: dict[int, dict[str, np.ndarray]], counts: dict[int, int]) -> None:
    """The round's checkpoint within the SecAgg+ bound, plus the browsers' tolerance, of the float64 FedAvg."""
    assert written is not None
    nodes = sorted(updates)
    listed, weights = [updates[n] for n in nodes], [counts[n] for n in nodes]
    average = fedavg(listed, weights)
    limit = secagg_bound(listed, weights, average) + BROWSER_ATOL
    got = checkpoint_values(written)
    worst = max(np.max(np.abs(got[name].astype(np.float64) - average[name])) for name in average)
    assert 0 < worst <= limit, (worst, limit)


def _assert_replies_hide(contents: list[RecordDict], updates: list[dict[str, np.ndarray]], *, exact: bool) -> None:
    """A device's replies to the workflow: no weights, and per round a masked vector that hides its update.

    With `exact` (a Python device, which trains as the reference does bit for bit), no update's bytes appear anywhere.
    """
    assert len(contents) == 4 * len(updates)  # the four stages, each round
    assert not [array.data for content in contents for arrays in content.array_records.values()
                for array in arrays.values() if array.data]
    vectors = [_masked(dict(c.config_records[RECORD_KEY_CONFIGS])) for c in contents
               if Key.MASKED_PARAMETERS in c.config_records[RECORD_KEY_CONFIGS]]
    assert len(vectors) == len(updates)
    for vector, update in zip(vectors, updates, strict=True):
        _assert_hidden(vector, update)
    if exact:
        blobs = [item for content in contents for config in content.config_records.values()
                 for value in config.values() for item in (value if isinstance(value, list) else [value])
                 if isinstance(item, bytes)]
        assert all(value.tobytes() not in blob for update in updates for value in update.values() for blob in blobs)


def _assert_frames_hide(sent: list[bytes | dict[str, Any]], updates: list[dict[str, np.ndarray]]) -> None:
    """What a page sent on its socket: SecAgg+ frames only, 64-bit node ids as digits, masked vectors that hide."""
    assert all(isinstance(frame, bytes) for frame in sent)
    unpacked = [unpack(frame, device="page") for frame in sent]  # type: ignore[arg-type]
    assert [header["type"] for header, _ in unpacked] == ["secagg"] * 4 * len(updates)
    assert all("weights" not in header for header, _ in unpacked)
    for stage, update in zip(range(0, len(unpacked), 4), updates, strict=True):
        assert f'{{"int": "{FIRST}"}}' in json.dumps(unpacked[stage + 1][0]["record"])  # the share keys' destinations
        header, payload = unpacked[stage + 2]
        _assert_hidden(_masked(decode_record(header["record"], payload, header.get("blobs"), device="page")), update)


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_python_node_and_chromium_devices_complete_secagg_rounds_and_none_sends_its_update(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    fleet = BrowserFleet(web, DATA, port=0, devices=2, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=30)
    server = RecordedServer(GlobalModel(exported), rounds=2, directory=tmp_path, devices=4, secagg=SECAGG,
                            device_timeout=60)
    simulated = LocalGrid(DeviceClient(web.directory, SIMULATED).client_app(mods=secure_mods()), nodes=2,
                          first_node=FIRST)
    frames: dict[int, tuple[int, list[bytes | dict[str, Any]]]] = {}  # node -> (partition, each frame it sent)
    receive = fleet.hub.receive

    def recorded(device: Any, frame: bytes | dict[str, Any]) -> None:
        frames.setdefault(device.node_id, (device.partition, []))[1].append(frame)
        receive(device, frame)

    fleet.hub.receive = recorded  # type: ignore[method-assign]
    with fleet, chromium({"page": f"{fleet.url}&name=page"}), node_beside(
            NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--name", "node") as node:
        try:
            fleet.run(server, join_timeout=90, beside=simulated)
        finally:
            fleet.close()
    assert node.process.returncode == 0, node.stderr[-3000:]
    assert fleet.refusals == []
    assert [(r.devices, r.halted, r.failures) for r in server.history] == [(4, None, {})] * 2

    partitions = {node_id: (DATA, partition) for node_id, (partition, _) in frames.items()}
    partitions |= {FIRST + i: (SIMULATED, i) for i in range(2)}
    assert sorted(partitions) == [1, 2, FIRST, FIRST + 1]
    rounds = []
    start = initial_values(exported)
    for record in server.history:  # each round from the values the server sent: the last round's checkpoint
        updates, counts = _references(web.directory, start, partitions)
        _assert_fedavg(record.checkpoint, updates, counts)
        rounds.append(updates)
        start = checkpoint_values(round_path(tmp_path, record.server_round))

    assert sorted(server.transport.replies) == sorted(partitions)
    for node_id, contents in server.transport.replies.items():
        _assert_replies_hide(contents, [updates[node_id] for updates in rounds], exact=node_id >= FIRST)
    for node_id, (_, sent) in frames.items():
        _assert_frames_hide(sent, [updates[node_id] for updates in rounds])
