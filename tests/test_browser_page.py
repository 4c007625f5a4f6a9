"""The fleet's page as a person sees it: headless Chromium's DOM once the page has settled (``--dump-dom``).

A page that joined shows the fleet's name, its device name and status, the rounds it took part in
and the leave button; a page beyond the fleet's maximum says that the fleet is full.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from ort_lightning import TrainingArtifacts

from ._web import chromium_program, ort_web_dist
from .helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from websockets.sync.client import connect  # noqa: E402

from ort_lightning.fleet.browser import BrowserFleet  # noqa: E402

from .test_browser_fleet import CHROMIUM_FLAGS, DATA, digits_folders  # noqa: E402, F401


def _page_text(url: str, *, profile: Path | None = None) -> str:
    """The page's DOM once Chromium has loaded it, joined and settled (its virtual time budget spent).

    A fresh browser profile each time, unless `profile` names one to keep (a reload in the same browser).
    """
    program = chromium_program()
    assert program is not None
    with tempfile.TemporaryDirectory(prefix="ort-lightning-chromium-") as fresh:
        run = subprocess.run([program, *CHROMIUM_FLAGS, f"--user-data-dir={profile or fresh}",
                              "--virtual-time-budget=30000", "--dump-dom", url], capture_output=True, text=True,
                             timeout=120)
    return run.stdout


@RunIf(chromium=True)
@pytest.mark.slow
def test_the_page_shows_its_fleet_device_status_rounds_and_a_leave_button(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path  # noqa: F811
) -> None:
    _, web = digits_folders
    with BrowserFleet(web, DATA, port=0, devices=1, ort_web=ort_web_dist(), name="digits on the 3rd floor") as fleet:
        joined = _page_text(fleet.url + "&name=pixel")
        url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + "&name=laptop"
        with connect(url, max_size=None) as laptop:
            json.loads(laptop.recv())  # welcome
            laptop.send(json.dumps({"type": "ready", "parameters": fleet.hub.parameters, "identity": "laptop-0001"}))
            assert json.loads(laptop.recv())["type"] == "admitted"
            full = _page_text(fleet.url + "&name=late")
    assert '<h1 id="fleet">digits on the 3rd floor</h1>' in joined
    assert f"pixel: ready ({fleet.hub.parameters} parameters); waiting for a round" in joined
    assert "rounds taken part in: 0" in joined
    assert ">Leave this fleet</button>" in joined
    assert "late: disconnected: 1008: late found the fleet full: 1 devices are connected, its most" in full
    kinds = [(event.device, event.kind) for event in fleet.hub.events]
    assert kinds[:2] == [("pixel", "joined"), ("pixel", "left")]
    assert ("late", "was refused") in kinds


@RunIf(chromium=True)
@pytest.mark.slow
def test_a_reloaded_page_comes_back_as_the_same_device(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path  # noqa: F811
) -> None:
    _, web = digits_folders
    profile = tmp_path / "profile"  # one browser profile: its localStorage holds the page's identity
    with BrowserFleet(web, DATA, port=0, devices=2, ort_web=ort_web_dist(), name="reload") as fleet:
        first = _page_text(fleet.url + "&name=pixel", profile=profile)
        joined = {device.name for device in fleet.connected}
        again = _page_text(fleet.url + "&name=reloaded", profile=profile)
    assert "pixel: ready" in first
    assert "pixel: ready" in again  # the server gave the page its own name back, not the one it asked for
    assert joined == set()  # the first page closed with its browser
    kinds = [(event.device, event.kind, event.detail) for event in fleet.hub.events]
    assert [(d, k) for d, k, _ in kinds] == [("pixel", "joined"), ("pixel", "left"), ("pixel", "came back"),
                                             ("pixel", "left")]
    assert kinds[0][2] == kinds[2][2] == "partition 0 of 2"
