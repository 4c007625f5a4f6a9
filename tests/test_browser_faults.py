"""Faults at a browser fleet's door and on its wire: one clear message for the page and one in the server's log.

A device here is a WebSocket client in Python that speaks the page's protocol (the page shows the
reason of the close it gets, ``disconnected: 1008: <reason>``, and a ``notice`` as "the fleet says:
..."; ``tests/test_browser_page.py`` checks that in Chromium). Each fault is checked on both sides:
what the device is told, and the one warning the server logs, which never holds the token.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_lightning import export_artifacts

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import ClientConnection, connect  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from ort_lightning.fleet.devices.frames import pack, unpack  # noqa: E402

CDN = "https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist"  # returned as given, never fetched
LOGGER = "ort_lightning.fleet.engines.browser"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("faults")
    export_artifacts(torch.nn.Linear(4, 2), torch.zeros(2, 4), folder / "artifacts", nominal_checkpoint=True,
                     verify=False)
    (folder / "data.js").write_text("export async function batches() { return []; }\n")
    return folder


def _fleet(tiny: Path, *, token: str | None = None, devices: int = 2) -> BrowserFleet:
    return BrowserFleet(tiny / "artifacts", page_data=tiny / "data.js", max_examples=8, port=0, devices=devices,
                        ort_web=CDN, token=token, device_timeout=30)


def _join_url(fleet: BrowserFleet, name: str, *, token: str | None = None) -> str:
    url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + f"&name={name}"
    return url if token is None else url.replace(f"token={fleet.token}", f"token={token}")


def _closed_with(socket: ClientConnection) -> tuple[int, str]:
    """The close code and reason the server ends `socket` with."""
    def drain() -> None:
        while True:
            socket.recv(timeout=30)

    with pytest.raises(ConnectionClosed) as closed:
        drain()
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


def _ready(socket: ClientConnection, fleet: BrowserFleet, identity: object) -> None:
    json.loads(socket.recv(timeout=30))  # welcome
    socket.send(json.dumps({"type": "ready", "parameters": fleet.hub.parameters, "identity": identity}))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("token", [None, "x", "another-fleet"], ids=["missing", "wrong", "another-fleet"])
def test_a_page_without_this_fleets_token_is_told_and_logged_without_the_token(
    tiny: Path, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _fleet(tiny) as fleet, _fleet(tiny, token="another-fleets-token") as other:
        sent = {None: "", "x": "x", "another-fleet": other.token}[token]
        page = fleet.url.replace(f"token={fleet.token}", f"token={sent}")
        with pytest.raises(urllib.error.HTTPError, match="403") as refused:
            urllib.request.urlopen(page, timeout=10)  # noqa: S310
        with connect(_join_url(fleet, "tab", token=sent)) as socket:
            code, reason = _closed_with(socket)
    assert "join token is missing or wrong (a page of another fleet, or of a run started with another token" in \
        refused.value.read().decode()
    assert (code, reason) == (1008, "wrong join token (another fleet's, or an earlier run's); open the URL the fleet "
                                    "printed")
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "a page from 127.0.0.1" in warnings[0]
    assert "a device's connection from 127.0.0.1" in warnings[1]
    assert all("came with a missing or wrong join token" in w for w in warnings)
    assert not [r for r in caplog.records if fleet.token in r.getMessage() or other.token in r.getMessage()]


@pytest.mark.parametrize(("identity", "frame", "expected"), [
    ("not valid!", None, "tab sent the device identity 'not valid!', but an identity is 8 to 64 letters"),
    ("identity-laptop", None, "tab claims the identity of laptop, which is connected: one identity is one device"),
    ("identity-tab-01", "hello", "tab sent a text frame that is not the fleet's wire format: 'hello' is not JSON"),
    ("identity-tab-01", '{"type": "result"}', "tab sent a text frame that is not the fleet's wire format: it is "
                                              "type 'result'"),
    ("identity-tab-01", b"\x01", "tab sent a binary frame of 1 bytes, shorter than its 4-byte header length"),
], ids=["unknown-identity", "claimed-identity", "text-not-json", "text-of-another-type", "binary-not-a-frame"])
def test_a_device_refused_for_its_identity_or_its_frames_is_told_why_and_logged(
    tiny: Path, identity: str, frame: str | bytes | None, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _fleet(tiny) as fleet, connect(_join_url(fleet, "laptop")) as laptop:
        _ready(laptop, fleet, "identity-laptop")
        assert json.loads(laptop.recv(timeout=30))["type"] == "admitted"
        with connect(_join_url(fleet, "tab")) as socket:
            _ready(socket, fleet, identity)
            if frame is not None:
                assert json.loads(socket.recv(timeout=30))["type"] == "admitted"
                socket.send(frame)
            code, reason = _closed_with(socket)
    assert code == 1008
    # NOTE: a WebSocket close reason holds at most 123 bytes: the page shows the first 120 of the server's message.
    assert reason.startswith(expected[:60]), reason
    [warning] = [w for w in _warnings(caplog) if w.startswith("tab ")]
    assert expected in warning


def test_a_reply_for_a_round_already_closed_is_dropped_and_the_device_told(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    notices: list[str] = []

    def device(fleet: BrowserFleet) -> None:
        with connect(_join_url(fleet, "laptop"), max_size=None) as socket:
            _ready(socket, fleet, "identity-laptop")
            assert json.loads(socket.recv(timeout=30))["type"] == "admitted"
            header, payload = unpack(socket.recv(timeout=30))
            weights = np.frombuffer(payload[: 4 * fleet.hub.parameters], np.float32)
            reply = pack({"type": "result", "id": header["id"], "round": header["round"], "examples": 4, "steps": 1,
                          "losses": [0.5], "last_epoch_steps": 1}, [weights])
            socket.send(reply)
            socket.send(reply)  # the same reply again: its round is closed for this device
            notices.append(json.loads(socket.recv(timeout=30))["message"])

    server = FleetServer(GlobalModel(tiny / "artifacts"), FedAvg(fraction_evaluate=0.0, min_available_nodes=1,
                                                                  min_train_nodes=1), rounds=1, directory=tmp_path)
    with _fleet(tiny, devices=1) as fleet:
        thread = threading.Thread(target=device, args=(fleet,))
        thread.start()
        fleet.run(server, join_timeout=30)
        thread.join(timeout=30)
    expected = ("laptop sent its reply to round 1 after that round had closed for it (it had answered already, "
                "failed, or the round ended without it); the reply is dropped")
    assert notices == [expected]
    assert expected in _warnings(caplog)
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 1)]
    assert sorted((r.device, r.server_round, r.outcome) for r in fleet.hub.ledger.receipts) == [
        ("laptop", 1, "dropped"), ("laptop", 1, "used")]
