"""The fleet's page as a person sees it: headless Chromium driven over its DevTools protocol.

A page that joined shows the fleet's name, its device name and status, the rounds it took part in
and the leave button; a page beyond the fleet's maximum says that the fleet is full. Each check
waits for the text it expects (a page on a busy machine takes seconds to load onnxruntime-web),
rather than reading the page once after a fixed budget.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from ort_lightning import TrainingArtifacts
from tests._web import chromium_program, ort_web_dist
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import ArrayRecord, Message, MetricRecord  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from tests.fleet.engines.browser.chromium import CHROMIUM_FLAGS  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import DATA  # noqa: E402


def _page_text(url: str, pattern: str, profile: Path, fleet: BrowserFleet) -> str:
    """The page's text once it shows `pattern`; then its browser closes, and the fleet sees the device go.

    `profile` is the browser's profile folder: the same one again is a reload in the same browser.
    """
    tab = _DevTools(profile)
    try:
        tab.call("Page.navigate", url=url)
        return tab.wait_for(pattern)
    finally:
        tab.close()
        end = time.monotonic() + 30
        while fleet.connected and time.monotonic() < end:
            time.sleep(0.02)


@RunIf(chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_the_page_shows_its_fleet_device_status_rounds_and_a_leave_button(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    _, web = digits_folders
    with BrowserFleet(web, DATA, port=0, devices=1, ort_web=ort_web_dist(), name="digits on the 3rd floor") as fleet:
        joined = _page_text(fleet.url + "&name=pixel", r"pixel: ready", tmp_path / "pixel", fleet)
        url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + "&name=laptop"
        with connect(url, max_size=None) as laptop:
            json.loads(laptop.recv())  # welcome
            laptop.send(json.dumps({"type": "ready", "parameters": fleet.hub.parameters, "identity": "laptop-0001"}))
            assert json.loads(laptop.recv())["type"] == "admitted"
            full = _page_text(fleet.url + "&name=late", r"late: disconnected", tmp_path / "late", fleet)
    assert joined.startswith("digits on the 3rd floor\n")
    assert f"pixel: ready ({fleet.hub.parameters} parameters); waiting for a round" in joined
    assert "rounds taken part in: 0" in joined
    assert joined.rstrip().endswith("Leave this fleet")
    assert "late: disconnected: 1008: late found the fleet full: 1 devices are connected, its most" in full
    kinds = [(event.device, event.kind) for event in fleet.hub.events]
    assert kinds[:2] == [("pixel", "joined"), ("pixel", "left")]
    assert ("late", "was refused") in kinds


@RunIf(chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_reloaded_page_comes_back_as_the_same_device(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    _, web = digits_folders
    profile = tmp_path / "profile"  # one browser profile: its localStorage holds the page's identity
    with BrowserFleet(web, DATA, port=0, devices=2, ort_web=ort_web_dist(), name="reload") as fleet:
        # NOTE: a tab driven over DevTools, not --dump-dom: Chromium's virtual time runs out while the page waits on
        # its Cache Storage (the device files it keeps), which is no network request. _page_text closes the browser
        # and waits until the fleet has seen the page go: one that came back before would be a second tab.
        first = _page_text(fleet.url + "&name=pixel", r"pixel: ready", profile, fleet)
        joined = {device.name for device in fleet.connected}
        again = _page_text(fleet.url + "&name=reloaded", r"pixel: ready", profile, fleet)
    assert "pixel: ready" in first
    assert "pixel: ready" in again  # the server gave the page its own name back, not the one asked
    assert joined == set()  # the first page closed with its browser
    kinds = [(event.device, event.kind, event.detail) for event in fleet.hub.events]
    assert [(d, k) for d, k, _ in kinds] == [("pixel", "joined"), ("pixel", "left"), ("pixel", "came back"),
                                             ("pixel", "left")]
    assert kinds[0][2] == kinds[2][2] == "partition 0 of 2"


# ----------------------------------------------------------------------------- a screenshot at each state
class _DevTools:
    """One headless Chromium tab driven over the DevTools protocol: navigate, read the page's text, screenshot."""

    def __init__(self, profile: Path) -> None:
        program = chromium_program()
        assert program is not None
        self.process = subprocess.Popen([program, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                         "--remote-debugging-port=0", "--window-size=900,600", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.process.stderr is not None
        browser = next(line for line in self.process.stderr if "DevTools listening on" in line).split()[-1]
        port = browser.split(":")[2].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:  # noqa: S310
            page = next(t for t in json.loads(answer.read()) if t["type"] == "page")
        self.socket = connect(page["webSocketDebuggerUrl"], max_size=None)
        self._ids = 0

    def call(self, method: str, **params: object) -> dict:
        self._ids += 1
        self.socket.send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == self._ids:
                return message.get("result", {})

    def text(self) -> str:
        """The page's visible text (its heading, status, rounds, notice and button)."""
        result = self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''")
        return str(result["result"].get("value", ""))

    def wait_for(self, pattern: str, timeout: float = 90) -> str:
        """The page's text once `pattern` matches it (polled every 20 ms)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if re.search(pattern, text := self.text()):
                return text
            time.sleep(0.02)
        raise AssertionError(f"the page never showed {pattern!r}; it shows {self.text()!r}")

    def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(data)
        return data

    def close(self) -> None:
        """Close the browser as a person does (its profile's localStorage written), killing it only if it hangs."""
        self._ids += 1
        with contextlib.suppress(Exception):
            self.socket.send(json.dumps({"id": self._ids, "method": "Browser.close", "params": {}}))
        self.socket.close()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _AggregatesWhenSet(FedAvg):
    """Flower's FedAvg that aggregates a round only once `go` is set (at most 120 s later)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.go = threading.Event()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.go.wait(timeout=120)
        return super().aggregate_train(server_round, replies)


@RunIf(chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_screenshot_at_each_state_of_the_page_shows_what_a_person_needs(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    shots = tmp_path / "screenshots"
    shots.mkdir()
    texts: dict[str, str] = {}
    tab = _DevTools(tmp_path / "profile")
    strategy = _AggregatesWhenSet(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    server = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=tmp_path / "rounds")
    # NOTE: many local epochs, so that the round lasts seconds and the page is caught training; the round ends only
    # once "sent" is on screen, since the run's end replaces it at once.
    try:
        with BrowserFleet(web, DATA, port=0, devices=1, epochs=30, ort_web=ort_web_dist(), name="digits") as fleet:
            tab.call("Page.navigate", url=fleet.url + "&name=pixel")
            waiting = r"pixel: ready \(\d+ parameters\); waiting for a round"
            texts["waiting"] = tab.wait_for(waiting)
            tab.screenshot(shots / "waiting.png")
            tab.call("Runtime.evaluate", expression="document.getElementById('leave').click()")
            texts["left"] = tab.wait_for(r"left this fleet; reload the page to join again as this device")
            tab.screenshot(shots / "left.png")
            url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + "&name=laptop"
            with connect(url, max_size=None) as laptop:
                json.loads(laptop.recv())  # welcome
                laptop.send(json.dumps({"type": "ready", "parameters": fleet.hub.parameters, "identity": "laptop-01"}))
                assert json.loads(laptop.recv())["type"] == "admitted"
                tab.call("Page.reload")
                texts["full"] = tab.wait_for(r"found the fleet full: 1 devices are connected, its most")
                tab.screenshot(shots / "full.png")
            end = time.monotonic() + 30
            while fleet.connected and time.monotonic() < end:
                time.sleep(0.02)
            tab.call("Page.reload")
            tab.wait_for(waiting)
            runner = threading.Thread(target=fleet.run, args=(server,), kwargs={"join_timeout": 90})
            runner.start()
            for state, pattern in [("training", r"pixel: round 1, epoch \d+/30, step \d+/\d+, loss \d+\.\d{4}"),
                                   ("sent", r"pixel: round 1 sent, loss \d+\.\d{4}; waiting for the next round")]:
                texts[state] = tab.wait_for(pattern)
                assert tab.screenshot(shots / f"{state}.png").startswith(b"\x89PNG")
            strategy.go.set()
            runner.join(timeout=120)
            texts["finished"] = tab.wait_for(r"pixel: the fleet's run finished; this device took part in 1 round")
            tab.screenshot(shots / "finished.png")
            with connect(url, max_size=None) as late, pytest.raises(ConnectionClosed) as closed:
                late.recv()
    finally:
        tab.close()
    assert closed.value.rcvd is not None  # a page that comes after the run is told that it finished
    assert closed.value.rcvd.code == 4000
    for state, text in texts.items():
        assert text.startswith("digits\n"), (state, text)
        assert "Leave this fleet" in text
    assert "rounds taken part in: 0" in texts["training"]
    assert "rounds taken part in: 1" in texts["sent"]
    assert "pixel: disconnected: 1008: pixel found the fleet full" in texts["full"]
    assert sorted(path.name for path in shots.iterdir()) == [f"{s}.png" for s in sorted(texts)]
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 1)]


@RunIf(chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_page_reconnects_to_a_server_restarted_with_the_same_token(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    _, web = digits_folders
    tab = _DevTools(tmp_path / "profile")
    options = {"devices": 1, "ort_web": ort_web_dist(), "token": "the-same-token-after-a-restart"}
    try:
        with BrowserFleet(web, DATA, port=0, **options) as first:  # type: ignore[arg-type]
            port = first.port
            tab.call("Page.navigate", url=first.url + "&name=pixel")
            tab.wait_for(r"pixel: ready")
        away = tab.wait_for(r"the fleet is out of reach; trying again every 3 s")
        with BrowserFleet(web, DATA, port=port, **options) as second:  # type: ignore[arg-type]
            back = tab.wait_for(r"pixel: ready \(\d+ parameters\); waiting for a round", timeout=30)
            assert second.wait_for_devices(10)
    finally:
        tab.close()
    assert "pixel: disconnected: 10" in away
    assert "Leave this fleet" in back
    assert [(event.device, event.kind) for event in second.hub.events] == [("pixel", "joined")]
