"""Devices that come and go, and TLS, in a browser fleet: the population, the hub, the grid's bounded wait.

These run the fleet's own objects without browsers: a `BrowserDevice` stands for a page's socket.
The whole loop with pages (rounds that equal ONNX Runtime's Python loop) is in
``tests/fleet/engines/browser/test_browser_fleet.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import subprocess
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Message, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from ort_lightning import export_artifacts  # noqa: E402
from ort_lightning.errors import ConfigurationError, FleetError  # noqa: E402
from ort_lightning.fleet import BrowserDevice, BrowserFleet  # noqa: E402
from ort_lightning.fleet.config.fleet_config import FleetConfig  # noqa: E402
from ort_lightning.fleet.devices.weight_order import WeightOrder  # noqa: E402
from ort_lightning.fleet.engines.browser.grid import BrowserGrid, PageData, strategy_floor  # noqa: E402
from ort_lightning.fleet.engines.browser.hub import Hub  # noqa: E402
from ort_lightning.fleet.engines.browser.population import Population  # noqa: E402
from ort_lightning.fleet.engines.browser.reply import Asked  # noqa: E402
from ort_lightning.fleet.engines.browser.tls import is_loopback, tls_files  # noqa: E402
from ort_lightning.fleet.server.global_model import _failures  # noqa: E402
from ort_lightning.fleet.server.report import report  # noqa: E402
from ort_lightning.fleet.server.server_app import FleetServer, RoundRecord  # noqa: E402

CDN = "https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist"
SPECS = WeightOrder([("weight", (2, 3)), ("bias", (2,))])


def _hub(partitions: int = 2) -> tuple[Hub, list]:
    events: list = []
    return Hub(partitions=partitions, weight_order=SPECS, device_timeout=5.0, on_event=events.append), events


def _page(hub: Hub, name: str, identity: object) -> tuple[BrowserDevice, str | None]:
    device = BrowserDevice(name, "127.0.0.1:1")
    hub.join(device)
    return device, hub.ready(device, hub.parameters, identity)


def test_a_device_that_comes_back_is_the_same_device() -> None:
    hub, events = _hub()
    laptop, refused = _page(hub, "laptop", "identity-laptop")
    phone, _ = _page(hub, "phone", "identity-phone")
    assert refused is None
    assert [(d.name, d.partition, d.node_id) for d in (laptop, phone)] == [("laptop", 0, 1), ("phone", 1, 2)]
    hub.lost(laptop, "laptop closed its page or lost its connection (WebSocket close code 1001)")
    assert hub.node_ids() == [2]
    reloaded, refused = _page(hub, "", "identity-laptop")
    assert refused is None
    assert (reloaded.name, reloaded.partition, reloaded.node_id) == ("laptop", 0, 1)
    assert [(e.device, e.kind) for e in events] == [("laptop", "joined"), ("phone", "joined"), ("laptop", "left"),
                                                   ("laptop", "came back")]
    assert events[-1].describe() == "round 0: laptop came back from 127.0.0.1:1 (partition 0 of 2)"


@pytest.mark.parametrize(("identity", "message"), [
    ("identity-laptop", r"tab claims the identity of laptop, which is connected: one identity is one device"),
    ("no", r"tab sent the device identity 'no', but an identity is 8 to 64 letters, digits, '-' or '_'"),
    (None, r"tab sent the device identity 'None', but an identity is 8 to 64"),
    ("identity-third", r"tab found the fleet full: 2 devices are connected, its most; try again when one leaves"),
], ids=["claims-a-connected-identity", "malformed", "missing", "beyond-the-maximum"])
def test_pages_the_fleet_cannot_admit_are_told_why(identity: object, message: str) -> None:
    hub, events = _hub()
    _page(hub, "laptop", "identity-laptop")
    _page(hub, "phone", "identity-phone")
    _, refused = _page(hub, "tab", identity)
    assert refused is not None
    assert re.search(message, refused), refused
    assert (events[-1].device, events[-1].kind) == ("tab", "was refused")
    assert hub.node_ids() == [1, 2]


def test_a_newcomer_takes_a_partition_no_absent_device_held_first() -> None:
    population = Population(partitions=3)
    a = population.admit("identity-a", "a", connected={}).member
    b = population.admit("identity-b", "b", connected={}).member
    assert a is not None
    assert b is not None
    # a is away: a newcomer takes partition 2 (never held), then partition 0 once the fleet has no other
    c = population.admit("identity-c", "c", connected={"identity-b": "b"}).member
    d = population.admit("identity-d", "d", connected={"identity-b": "b", "identity-c": "c"}).member
    assert (c.partition if c else None, d.partition if d else None) == (2, 0)
    # a comes back while d holds its partition, and a free one is left for it once c has gone
    back = population.admit("identity-a", "a", connected={"identity-b": "b", "identity-d": "d"})
    assert back.came_back
    assert back.member is not None
    assert (back.member.node_id, back.member.partition) == (1, 2)


def test_too_few_devices_for_longer_than_the_wait_stop_the_run() -> None:
    hub, _ = _hub()
    _page(hub, "laptop", "identity-laptop")
    grid = BrowserGrid(hub, PageData(1, 10), floor=1, wait_timeout=0.2)
    assert list(grid.get_node_ids()) == [1]
    short = BrowserGrid(hub, PageData(1, 10), floor=2, wait_timeout=0.2)
    with pytest.raises(FleetError, match=r"waited 0.2 s after round 0 for 2 devices \(the strategy's minimum\), but "
                                         r"1 stayed connected; the run stops here"):
        short.get_node_ids()
    assert strategy_floor(FedAvg(min_available_nodes=3, min_train_nodes=2)) == 3
    assert strategy_floor(object()) == 1


def _owing(hub: Hub, device: BrowserDevice, server_round: int) -> Message:
    """A train message `device` owes (its frame goes nowhere: the test stands for the page)."""

    async def nowhere(frame: bytes | str) -> None:
        del frame

    def schedule(coroutine: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_result(asyncio.run(coroutine))
        return future

    device.send = nowhere
    hub.bind(schedule)
    message = Message(RecordDict(), dst_node_id=device.node_id, message_type="train")
    message.metadata.__dict__["_message_id"] = f"{device.name}-{server_round}"
    hub.send(message, b"", Asked(1, 1, server_round))
    return message


def test_a_device_that_leaves_mid_round_is_recorded_as_left_not_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ServerApp's identity, as Flower's own run sets it, for the messages the workflow makes.
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    hub, events = _hub(partitions=3)
    _page(hub, "a", "identity-a")
    b, _ = _page(hub, "b", "identity-b")
    c, _ = _page(hub, "c", "identity-c")
    leaving, crashing = _owing(hub, b, 2), _owing(hub, c, 2)
    hub.lost(b, "b pressed its leave button", left=True)
    hub.lost(c, "c closed its page or lost its connection (WebSocket close code 1006)")
    replies = hub.collect([leaving.metadata.message_id, crashing.metadata.message_id], wait=1.0)
    assert [(r.device, r.server_round) for r in hub.refusals] == [("c", 2)]
    assert [e.describe() for e in events[-2:]] == [
        "round 2: b left: pressed its leave button",
        "round 2: c was dropped: closed its page or lost its connection (WebSocket close code 1006)"]
    failures, left = _failures([leaving, crashing], replies, None)
    assert left == {b.node_id: "b pressed its leave button"}
    assert failures == {c.node_id: "c closed its page or lost its connection (WebSocket close code 1006)"}
    # what the CLI prints and writes: one line each, leaving apart from failing in history.json
    record = RoundRecord(2, 1.0, {"accuracy": 0.5, "loss": 1.0}, failures=failures, left=left)
    config = FleetConfig.from_dict({"output": {"folder": str(tmp_path), "plot": False}})
    report(cast(FleetServer, SimpleNamespace(initial={}, history=[record])), config, 1.0)
    printed = capsys.readouterr().out
    assert f"node {b.node_id} left: b pressed its leave button" in printed
    assert printed.count("b pressed its leave button") == 1
    assert printed.count("failed") == 1
    [written] = json.loads((tmp_path / "history.json").read_text())["rounds"]
    assert (written["left"], written["failures"]) == ({str(b.node_id): left[b.node_id]},
                                                      {str(c.node_id): failures[c.node_id]})


# ----------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "artifacts"
    export_artifacts(torch.nn.Linear(4, 2), torch.zeros(2, 4), folder, nominal_checkpoint=True, verify=False)
    return folder


def _certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_and_plain_http_off_loopback_warns_once_without_the_token(
    tiny_folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import ssl
    import urllib.request

    cert, key = _certificate(tmp_path)
    with BrowserFleet(tiny_folder, lambda p, n: None, port=0, devices=2, ort_web=CDN, certfile=cert,  # type: ignore[arg-type,return-value]
                      keyfile=key) as fleet:
        assert fleet.url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(cert))
        context.check_hostname = False
        with urllib.request.urlopen(fleet.url, context=context, timeout=10) as response:  # noqa: S310
            assert b"Leave this fleet" in response.read()
    caplog.set_level(logging.DEBUG)
    with BrowserFleet(tiny_folder, lambda p, n: None, host="0.0.0.0", port=0, devices=2, ort_web=CDN) as fleet:  # type: ignore[arg-type,return-value]
        token = fleet.token
    warnings = [r.getMessage() for r in caplog.records if "without TLS" in r.getMessage()]
    assert len(warnings) == 1
    assert "the join token and every update travel in clear" in warnings[0]
    assert not [r for r in caplog.records if token in r.getMessage()]
    assert is_loopback("::1")
    assert not is_loopback("192.168.1.20")


@pytest.mark.parametrize(("certfile", "keyfile", "message"), [
    ("cert.pem", None, r"Expected both certfile and keyfile for TLS, but got certfile without keyfile"),
    ("missing.pem", "missing-key.pem", r"Expected `certfile` to be a PEM file, but '.*missing.pem' does not exist"),
], ids=["cert-without-key", "missing-files"])
def test_tls_files_are_checked(certfile: str, keyfile: str | None, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=message):
        tls_files(tmp_path / certfile, None if keyfile is None else tmp_path / keyfile)
