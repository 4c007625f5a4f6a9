"""Flower's SecAgg+ over a browser fleet: the hub's refusals of bad answers, and the fleet config's route.

A Python device speaks the page's wire over a raw WebSocket and answers each stage with Flower's own
client functions (``secaggplus_mod``'s ``_setup``, ``_share_keys``, ``_collect_masked_vectors``,
``_unmask``), but for the one answer its fault spoils. Three Node devices (``node_device.mjs``, the
page's code) answer honestly. A fleet config with ``engine: browser`` and ``secagg.enabled`` runs its
round on Node devices through ``run_fleet``. The reference is ONNX Runtime's documented loop per honest
device, averaged by example count in float64 (``digits_rounds.reference_rounds``), never the fleet's code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import NODE_DEVICE, free_port, node_beside, node_devices_when_served, ort_web_dist
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Message, RecordDict  # noqa: E402
from flwr.client.mod.secure_aggregation.secaggplus_mod import (  # noqa: E402
    SecAggPlusState,
    _collect_masked_vectors,
    _setup,
    _share_keys,
    _unmask,
)
from flwr.common import bytes_to_ndarray, ndarray_to_bytes, ndarrays_to_parameters  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from ort_lightning.fleet import BrowserDevice, BrowserFleet, GlobalModel  # noqa: E402
from ort_lightning.fleet.devices.frames import decode_record, encode_record, pack, unpack  # noqa: E402
from ort_lightning.fleet.devices.weight_order import WeightOrder  # noqa: E402
from ort_lightning.fleet.engines.browser.hub import Hub  # noqa: E402
from ort_lightning.fleet.engines.browser.reply import Asked  # noqa: E402
from ort_lightning.fleet.run import run_fleet  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    LR,
    assert_round,
    checkpoint_values,
    initial_values,
    reference_rounds,
)
from tests.fleet.secure_bound import fedavg, secagg_bound  # noqa: E402

TOKEN = "secure-fleet"
#: Each faulty device's spoiled answer (its stage and round), and the one line the hub refuses it with.
FAULTS = {
    "result": ("setup", 1, r"result answered SecAgg\+'s setup stage with a 'result' frame, but a 'secagg' frame "
                           r"was expected; the device is refused"),
    "missing": ("setup", 1, r"missing answered SecAgg\+'s setup stage with \['pk1'\], but \['pk1', 'pk2'\] were "
                            r"expected; the device is refused"),
    "kind": ("setup", 1, r"kind sent pk2 of SecAgg\+'s setup stage as 42, but bytes was expected; the device is "
                         r"refused"),
    "shape": ("collect_masked_vectors", 2, r"shape sent masked vectors of \[\('int64', \(1,\)\), \('int64', "
                                           r"\(1024,\)\), .*\], but int64 arrays of shapes \[\(1,\), \(16, 64\), .*\] "
                                           r"were expected; the device is refused"),
    "npy": ("collect_masked_vectors", 2, r"npy sent masked vectors that are not \.npy bytes \(EOF: reading array "
                                         r"data, expected \d+ bytes got \d+\); the device is refused"),
}


def _owing(hub: Hub, device: BrowserDevice, stage: str | None) -> Message:
    """A train message `device` owes at SecAgg+'s `stage` of round 1 (its frame goes nowhere: the test is the page)."""

    async def nowhere(frame: bytes | str) -> None:
        del frame

    def schedule(coroutine: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_result(asyncio.run(coroutine))
        return future

    device.send, device.close = nowhere, lambda code, reason: nowhere(reason)
    hub.bind(schedule)
    message = Message(RecordDict(), dst_node_id=device.node_id, message_type="train")
    message.metadata.__dict__["_message_id"] = f"{device.name}-{stage}"
    hub.send(message, b"", Asked(8, 1, 1, stage))
    return message


def test_a_device_that_cannot_answer_a_secagg_stage_stays_and_one_that_cannot_train_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A ServerApp's identity, as Flower's own run sets it, for the messages the workflow makes.
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    hub = Hub(partitions=2, weight_order=WeightOrder([("weight", (2, 3))]), device_timeout=5.0)
    pages = [BrowserDevice(name, "127.0.0.1:1") for name in ("a", "b")]
    for page in pages:
        hub.join(page)
        assert hub.ready(page, hub.parameters, f"identity-{page.name}") is None
    asked = [_owing(hub, pages[0], "unmask"), _owing(hub, pages[1], None)]
    for page in pages:
        hub.receive(page, {"type": "error", "message": "Node 2: the server asked for the share of Node 9"})
    replies = hub.collect([message.metadata.message_id for message in asked], wait=1.0)
    assert [reply.error.reason for reply in replies] == [
        "a could not answer SecAgg+'s unmask stage of round 1: Node 2: the server asked for the share of Node 9",
        "b could not train round 1: Node 2: the server asked for the share of Node 9"]
    assert hub.node_ids() == [pages[0].node_id]
    assert [(refusal.device, refusal.server_round) for refusal in hub.refusals] == [("b", 1)]
    assert sorted((r.device, r.outcome) for r in hub.ledger.receipts) == [("a", "refused"), ("b", "refused")]


def _spoil(fault: str, answer: dict[str, Any]) -> dict[str, Any]:
    if fault == "missing":
        return {"pk1": answer["pk1"]}
    if fault == "kind":
        return {**answer, "pk2": 42}
    vectors = answer["masked_params"]
    if fault == "shape":
        return {"masked_params": [ndarray_to_bytes(bytes_to_ndarray(v).reshape(-1)) for v in vectors]}
    return {"masked_params": [vector[:-8] for vector in vectors]}


def _reply(fault: str, stage: str, header: dict[str, Any], answer: dict[str, Any]) -> bytes:
    """The secagg frame answering `stage`, spoiled where and when `fault` spoils it."""
    reply = {"type": "secagg", "id": header["id"]}
    if stage == "collect_masked_vectors":
        reply.update(examples=header["examples"], steps=1, losses=[1.0])
    if FAULTS[fault][:2] == (stage, header["round"]):
        if fault == "result":
            return pack({**reply, "type": "result"}, [np.zeros(4, np.float32)])
        answer = _spoil(fault, answer)
    blobs: list[np.ndarray] = []
    return pack({**reply, "record": encode_record(answer, blobs)}, blobs)


def _answer(state: SecAggPlusState, header: dict[str, Any], payload: memoryview) -> tuple[str, dict[str, Any]]:
    """The stage a frame asks for, and Flower's own client answer to it (the update: the weights it was sent)."""
    if header["type"] == "train":
        record = decode_record(header["secagg"], payload, header.get("blobs"), device="server")
        at, size = header["blobs"][header["weights"]]
        weights = np.frombuffer(payload[at : at + size], np.float32)
        arrays = [weights[start:end].reshape(shape) for start, end, shape in header["layout"]]
        del record["stage"]
        return "collect_masked_vectors", _collect_masked_vectors(state, record, header["examples"],
                                                                 ndarrays_to_parameters(arrays))
    record = decode_record(header["record"], payload, header.get("blobs"), device="server")
    stage = record.pop("stage")
    if stage == "setup":
        state.nid = int(header["node"])
        return stage, _setup(state, record)
    return stage, {"share_keys": _share_keys, "unmask": _unmask}[stage](state, record)


def _python_device(fleet: BrowserFleet, fault: str, closed: dict[str, tuple[int, str]]) -> None:
    """A device named after its fault: Flower's client answers, an error frame where they raise (as a page's)."""
    url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + f"&name={fault}"
    state = SecAggPlusState()
    with connect(url, max_size=None) as link:
        try:
            json.loads(link.recv())  # welcome
            ready = {"type": "ready", "parameters": fleet.hub.parameters, "identity": f"python-device-{fault}"}
            link.send(json.dumps(ready))
            assert json.loads(link.recv())["type"] == "admitted"
            while True:
                header, payload = unpack(link.recv(timeout=120))
                try:
                    stage, answer = _answer(state, header, payload)
                except (KeyError, ValueError) as error:
                    link.send(json.dumps({"type": "error", "id": header["id"], "message": repr(error)}))
                    continue
                link.send(_reply(fault, stage, header, answer))
        except ConnectionClosed as error:
            closed[fault] = (error.rcvd.code, error.rcvd.reason) if error.rcvd else (0, "")


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_bad_secagg_answers_are_refused_in_one_line_and_the_fleet_goes_on(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    honest = 3
    devices = honest + len(FAULTS)
    fleet = BrowserFleet(web, DATA, port=0, devices=devices, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=20)
    server = SecureFleetServer(GlobalModel(exported), rounds=2, directory=tmp_path / "rounds", devices=devices,
                               secagg={"num_shares": 1.0, "reconstruction_threshold": 2}, min_nodes=honest)
    closed: dict[str, tuple[int, str]] = {}
    threads = [threading.Thread(target=_python_device, args=(fleet, name, closed), daemon=True) for name in FAULTS]
    with fleet, node_beside(NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--devices", honest) as node:
        for thread in threads:
            thread.start()
        try:
            fleet.run(server, join_timeout=60)
        finally:
            fleet.close()
    for thread in threads:
        thread.join(timeout=30)
    assert node.process.returncode == 0, node.stdout[-2000:] + node.stderr[-2000:]
    refusals = {refusal.device: refusal for refusal in fleet.refusals}
    assert sorted(refusals) == sorted(FAULTS)
    for fault, (_, server_round, words) in FAULTS.items():
        assert re.fullmatch(words + r" \(.+\)\.", refusals[fault].reason), refusals[fault].reason
        assert refusals[fault].server_round == server_round
        assert closed[fault][0] == 1008, closed[fault]
    first, second = server.history
    # The devices refused at setup never shared their keys, so the round leaves them out; the two that spoil round 2
    # answer round 1 with the weights they were sent (no training), which FedAvg counts by their examples.
    assert (first.devices, first.halted) == (honest + 2, None)
    partitions = {e.device: int(e.detail.split()[1]) for e in fleet.hub.events if e.kind == "joined"}
    chosen = sorted(partitions[name] for name in partitions if name not in FAULTS)
    start = initial_values(exported)
    loaders = {p: DATA(p, devices).train for p in [*chosen, partitions["shape"], partitions["npy"]]}
    updates = [ort_device_loop(web.directory, list(loaders[p]), lr=LR, graphs="ort", values=start) for p in chosen]
    updates += [start, start]
    counts = [len(loader.dataset) for loader in loaders.values()]  # type: ignore[arg-type]
    average = fedavg(updates, counts)
    assert_round(first.checkpoint, average, atol=secagg_bound(updates, counts, average) + BROWSER_ATOL)
    assert (second.devices, second.halted) == (honest, None)
    [expected] = reference_rounds(web.directory, checkpoint_values(first.checkpoint), [chosen], devices)
    assert_round(second.checkpoint, expected, atol=BROWSER_ATOL)


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_fleet_config_with_secagg_runs_its_round_on_node_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port, folder = free_port(), tmp_path / "secure"
    config = {"rounds": 1, "seed": 0, "model": {"hidden": 16, "verify": False},
              "devices": {"count": 3, "batch_size": 32, "timeout": 60},
              "secagg": {"enabled": True, "num_shares": 3, "reconstruction_threshold": 2},
              "engine": {"name": "browser", "port": port, "token": TOKEN, "ort_web": ort_web_dist()},
              "output": {"folder": str(folder), "plot": False}}
    outputs: list[str] = []
    devices = threading.Thread(target=node_devices_when_served, args=(port, TOKEN, 3, outputs), daemon=True)
    devices.start()
    history = run_fleet(config)
    devices.join(timeout=60)
    assert outputs[0].startswith("exit 0"), outputs
    printed = capsys.readouterr().out
    assert "3 devices, iid split, fedavg, SecAgg+, 3 browsers" in printed, printed
    line = r"^round  1: accuracy [\d.]+%  loss [\d.]+  \([\d.]+ s; 3 devices, .* back per device\)$"
    assert re.search(line, printed, re.MULTILINE), printed
    [record] = history["rounds"]
    assert (record["devices"], record["halted"], record["failures"]) == (3, None, {})
    [expected] = reference_rounds(folder / "device", checkpoint_values(folder / "artifacts" / "checkpoint"),
                                  [[0, 1, 2]], 3)
    assert_round(Path(record["checkpoint"]), expected, atol=BROWSER_ATOL)
