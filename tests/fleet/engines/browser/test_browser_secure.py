"""What the server sees of a secure round with a Chromium page and Node devices: masked vectors, never an update.

Every frame each device sends, and every frame the server sends each device, is kept at the hub (its
``receive``, ``ready`` and ``send``, wrapped before the run). Each device's plain update is ONNX
Runtime's documented loop (``tests.helpers.ort_device_loop``) on its partition, from the values the
server sent it; the round's aggregate is their float64 FedAvg within docs/fleets.md's SecAgg+ bound
(`tests.fleet.secure_bound`) plus the browsers' tolerance. Client-side DP clipping composes: the
devices clip before they mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import NODE_DEVICE, NodeRun, ort_web_dist, run_beside_node
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.common import bytes_to_ndarray  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import Key  # noqa: E402

from ort_lightning.fleet import BrowserFleet, GlobalModel  # noqa: E402
from ort_lightning.fleet.devices.frames import decode_record, unpack  # noqa: E402
from ort_lightning.fleet.engines.browser.hub import BrowserDevice, Hub  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer  # noqa: E402
from tests.fleet.engines.browser.chromium import chromium  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    DEVICES,
    LR,
    checkpoint_values,
    initial_values,
)
from tests.fleet.secure_bound import fedavg, secagg_bound  # noqa: E402

SECAGG = {"num_shares": 3, "reconstruction_threshold": 2, "timeout": 60.0}
ROUNDS = 2
NORM = 0.05
#: Consecutive float32 values of an update that must appear nowhere, at any byte offset, in what its device sent.
WINDOW = 4
Values = dict[str, np.ndarray]
#: What the server sends each device in a round: SecAgg+'s key stages as secagg frames, its collect stage as a train.
STAGES = [("secagg", "setup"), ("secagg", "share_keys"), ("train", "collect_masked_vectors"), ("secagg", "unmask")]


@dataclass
class Transport:
    """The frames each device sent (binary, or a text frame's JSON) and the frames the server sent it, by name."""

    received: dict[str, list[bytes | dict[str, Any]]] = field(default_factory=dict)
    sent: dict[str, list[bytes]] = field(default_factory=dict)
    partitions: dict[str, int] = field(default_factory=dict)

    def watch(self, hub: Hub) -> None:
        """Keep every frame through `hub` from now on (its own methods still handle them)."""
        receive, ready, send = hub.receive, hub.ready, hub.send

        def received(device: BrowserDevice, frame: bytes | dict[str, Any]) -> None:
            self.received.setdefault(device.name, []).append(frame)
            receive(device, frame)

        def readied(device: BrowserDevice, parameters: object, identity: object) -> str | None:
            refused = ready(device, parameters, identity)
            self.received.setdefault(device.name, []).append({"type": "ready", "parameters": parameters})
            self.partitions[device.name] = device.partition
            return refused

        def sending(message: Any, frame: bytes, asked: Any) -> None:
            device = hub.device(message.metadata.dst_node_id)
            self.sent.setdefault(device.name if device else "?", []).append(frame)
            send(message, frame, asked)

        hub.receive, hub.ready, hub.send = received, readied, sending  # type: ignore[method-assign]


@dataclass
class SecureRun:
    """A secure fleet run: its server, its transport, its Node devices' process."""

    server: SecureFleetServer
    transport: Transport
    node: NodeRun
    refusals: list[Any]
    #: Each tensor's (start, end) in the flat weights the frames carry.
    spans: dict[str, tuple[int, int]]


def _run(folders: tuple[TrainingArtifacts, TrainingArtifacts], folder: Path, *, page: bool, rounds: int,
         privacy: dict[str, Any] | None = None) -> SecureRun:
    exported, web = folders
    server = SecureFleetServer(GlobalModel(exported), rounds=rounds, directory=folder, devices=DEVICES,
                               secagg=SECAGG, privacy=privacy)
    fleet = BrowserFleet(web, DATA, port=0, devices=DEVICES, device_timeout=60, ort_web=ort_web_dist(),
                         wait_timeout=90)
    transport = Transport()
    transport.watch(fleet.hub)
    nodes = DEVICES - page
    with fleet, chromium({"page": f"{fleet.url}&name=page"} if page else {}):
        node = run_beside_node(fleet, server, NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--devices", nodes)
    return SecureRun(server, transport, node, fleet.refusals, fleet.hub.weight_order.spans)


@pytest.fixture(scope="module")
def mixed(digits_folders: tuple[TrainingArtifacts, TrainingArtifacts],
          tmp_path_factory: pytest.TempPathFactory) -> SecureRun:
    """Two secure rounds of a Chromium page and two Node devices."""
    return _run(digits_folders, tmp_path_factory.mktemp("secure-mixed"), page=True, rounds=ROUNDS)


def _trained(web: TrainingArtifacts, start: Values) -> list[Values]:
    """Each partition's trained values from `start`: ORT's documented loop on the device folder."""
    return [ort_device_loop(web.directory, [list(batch) for batch in DATA(p, DEVICES).train], lr=LR, graphs="ort",
                            values=start) for p in range(DEVICES)]


def _examples() -> list[int]:
    return [len(DATA(p, DEVICES).train.dataset) for p in range(DEVICES)]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(digits_folders: tuple[TrainingArtifacts, TrainingArtifacts],
              mixed: SecureRun) -> list[tuple[Values, list[Values]]]:
    """Per round: the values the server sent (the export's, then the last round's) and each partition's training."""
    exported, web = digits_folders
    starts = [initial_values(exported)]
    for record in mixed.server.history[:-1]:
        assert record.checkpoint is not None
        starts.append(checkpoint_values(record.checkpoint))
    return [(start, _trained(web, start)) for start in starts]


def _frames(frames: list[bytes | dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any], memoryview]]:
    """Each binary frame's header, its decoded SecAgg+ record (empty for a frame without one), its payload."""
    decoded = []
    for frame in frames:
        if isinstance(frame, bytes):
            header, payload = unpack(frame, device=name)
            record = header.get("record") or header.get("secagg")
            blobs = header.get("blobs")
            decoded.append((header, decode_record(record, payload, blobs, device=name) if record else {}, payload))
    return decoded


def _flat(values: Values, names: list[str]) -> np.ndarray:
    return np.concatenate([values[name].astype(np.float64).ravel() for name in names])


def _windows(values: Values) -> set[bytes]:
    """Every run of `WINDOW` consecutive float32 values of `values` holding no zero."""
    found = set()
    for value in values.values():
        flat = value.astype(np.float32).ravel()
        for at in range(flat.size - WINDOW + 1):
            if np.all(flat[at : at + WINDOW] != 0):
                found.add(flat[at : at + WINDOW].tobytes())
    return found


def _leaks(frame: bytes, windows: set[bytes]) -> int:
    size = 4 * WINDOW
    return sum(frame[at : at + size] in windows for at in range(len(frame) - size + 1))


def _legacy_names(run: SecureRun, header: dict[str, Any]) -> list[str]:
    """The legacy parameters' names in the order Flower sums them, from a collect stage's layout."""
    by_span = {span: name for name, span in run.spans.items()}
    return [by_span[(start, end)] for start, end, _ in header["layout"]]


def _collect_frames(run: SecureRun, name: str) -> dict[int, tuple[dict[str, Any], memoryview]]:
    """The collect stage's train frame the server sent device `name`, per round: its header and payload."""
    frames = _frames(list(run.transport.sent[name]), name)
    return {header["round"]: (header, payload) for header, _, payload in frames if header["type"] == "train"}


def _masked(run: SecureRun, name: str) -> dict[int, np.ndarray]:
    """Device `name`'s masked vectors per round (the weight's first), as int64 values."""
    masked = {}
    for header, record, _ in _frames(run.transport.received[name], name):
        if Key.MASKED_PARAMETERS in record:
            vectors = [bytes_to_ndarray(blob).ravel() for blob in record[Key.MASKED_PARAMETERS]]
            masked[header["round"]] = np.concatenate(vectors)
    return masked


# ----------------------------------------------------------------------------- the rounds
@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_page_and_node_devices_complete_secure_rounds_and_each_record_shows_them(mixed: SecureRun) -> None:
    assert mixed.node.process.returncode == 0, mixed.node.stderr[-3000:]
    assert mixed.refusals == []
    assert sorted(mixed.transport.partitions) == ["node-1", "node-2", "page"]
    assert sorted(mixed.transport.partitions.values()) == list(range(DEVICES))
    history = mixed.server.history
    assert [(r.server_round, r.devices, r.examples, r.failures, r.halted) for r in history] == [
        (n, DEVICES, sum(_examples()), {}, None) for n in range(1, ROUNDS + 1)]
    assert all(r.sent_bytes > 0 and r.received_bytes > 0 for r in history)
    assert len({(r.sent_bytes, r.received_bytes) for r in history}) == 1  # float32 values each round, as the first


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_the_server_sends_each_device_the_four_stages_and_the_global_values(
    mixed: SecureRun, reference: list[tuple[Values, list[Values]]]
) -> None:
    for name in mixed.transport.partitions:
        sent = [(h["round"], h["type"], r["stage"]) for h, r, _ in _frames(list(mixed.transport.sent[name]), name)]
        assert sent == [(n, kind, stage) for n in range(1, ROUNDS + 1) for kind, stage in STAGES], name
        size = sum(end - begin for begin, end in mixed.spans.values())
        for number, (header, payload) in _collect_frames(mixed, name).items():
            start, _ = reference[number - 1]  # the export's values, then the last round's aggregate
            weights = np.frombuffer(payload, "<f4", count=size, offset=header["blobs"][header["weights"]][0])
            for tensor, (begin, end) in mixed.spans.items():
                np.testing.assert_array_equal(weights[begin:end], start[tensor].ravel(), err_msg=tensor)


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_no_device_sends_its_update_its_masked_vectors_neither_equal_nor_correlate_with_it(
    mixed: SecureRun, reference: list[tuple[Values, list[Values]]]
) -> None:
    for name, partition in mixed.transport.partitions.items():
        received = mixed.transport.received[name]
        assert [f["type"] for f in received if isinstance(f, dict)] == ["ready"], name  # no error, no other text
        headers = [header for header, _, _ in _frames(received, name)]
        assert {header["type"] for header in headers} == {"secagg"}, name  # never a `result` frame
        assert sorted(header["round"] for header in headers) == [n for n in range(1, ROUNDS + 1) for _ in range(4)]
        masked = _masked(mixed, name)
        assert sorted(masked) == list(range(1, ROUNDS + 1))
        for number, vector in masked.items():
            start, trained = reference[number - 1]
            update = trained[partition]
            names = _legacy_names(mixed, _collect_frames(mixed, name)[number][0])
            plain, delta = _flat(update, names), _flat(update, names) - _flat(start, names)
            masked_values = vector[1:].astype(np.float64)
            assert masked_values.shape == plain.shape
            assert not np.array_equal(masked_values, plain)
            for compared in (plain, delta):
                assert abs(np.corrcoef(masked_values, compared)[0, 1]) < 0.1, (name, number)
            windows = _windows(update)
            assert _leaks(b"\1" + update[names[-1]].astype(np.float32).tobytes(), windows)  # it finds a plain tensor
            assert not any(_leaks(f, windows) for f in received if isinstance(f, bytes)), (name, number)


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_each_rounds_aggregate_is_the_fedavg_of_the_devices_updates_within_the_secagg_bound(
    mixed: SecureRun, reference: list[tuple[Values, list[Values]]]
) -> None:
    counts = _examples()
    for record, (start, trained) in zip(mixed.server.history, reference, strict=True):
        assert record.checkpoint is not None
        expected = fedavg(trained, counts)
        bound = secagg_bound(trained, counts, expected) + BROWSER_ATOL
        got = checkpoint_values(record.checkpoint)
        worst = max(np.max(np.abs(got[name].astype(np.float64) - expected[name])) for name in expected)
        assert 0 < worst <= bound, (record.server_round, worst, bound)
        assert max(np.max(np.abs(got[name] - start[name])) for name in start) > 10 * bound  # the round moved


# ----------------------------------------------------------------------------- with client-side DP
def _norm(end: Values, start: Values) -> float:
    return float(np.sqrt(sum(np.sum((end[n].astype(np.float64) - start[n]) ** 2) for n in start)))


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_client_side_clipping_composes_on_the_web_the_devices_clip_before_they_mask(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], mixed: SecureRun,
    reference: list[tuple[Values, list[Values]]], tmp_path: Path,
) -> None:
    privacy = {"side": "client", "clipping": "fixed", "noise_multiplier": 0.0, "clipping_norm": NORM}
    run = _run(digits_folders, tmp_path, page=False, rounds=1, privacy=privacy)
    assert run.node.process.returncode == 0, run.node.stderr[-3000:]
    (record,) = run.server.history
    assert (record.devices, record.failures, record.halted, run.refusals) == (DEVICES, {}, None, [])
    assert record.train_metrics["norm_bit"] == 1  # every device's update was above the norm, and clipped
    sent = [unpack(f)[0]["type"] for frames in run.transport.received.values() for f in frames if isinstance(f, bytes)]
    assert set(sent) == {"secagg"}
    start, trained = reference[0]
    clipped = []
    for update in trained:
        size = _norm(update, start)
        assert size > NORM
        clipped.append({name: start[name] + (update[name] - start[name]) * (NORM / size) for name in start})
    counts = _examples()
    expected = fedavg(clipped, counts)
    bound = secagg_bound(clipped, counts, expected) + BROWSER_ATOL
    assert record.checkpoint is not None
    got = checkpoint_values(record.checkpoint)
    assert max(np.max(np.abs(got[name].astype(np.float64) - expected[name])) for name in expected) <= bound
    values = sum(value.size for value in start.values())
    assert 0 < _norm(got, start) <= NORM + bound * np.sqrt(values)
    assert mixed.server.history[0].checkpoint is not None
    assert _norm(checkpoint_values(mixed.server.history[0].checkpoint), start) > 10 * NORM  # unclipped: far beyond
