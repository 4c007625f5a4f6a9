"""Node devices in a browser fleet (``node_device.mjs``: the page's FleetDevice and runner.js, in Node).

Two Node devices join a fleet of at most 2; ``b`` leaves (a departure, not a failure) while it owes
round 2 and joins again 0.5 s later, under another name, with the identity it kept. Round 2 is
then ``a``'s alone, round 3 waits for the strategy's two devices and has ``b`` back as itself (same name, node id and
partition). Each round equals the example-weighted float64 FedAvg of ONNX Runtime's documented
Python loop over the devices whose replies it used (``tests/fleet/engines/browser/test_browser_fleet.py``'s reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ort_lightning import TrainingArtifacts
from tests._web import ROOT, ort_web_dist, run_beside_node
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from tests.fleet.engines.browser.digits_rounds import BROWSER_ATOL, DATA, assert_round, initial_values, reference_rounds  # noqa: E402

DRIVER = ROOT / "tests" / "web" / "node_fleet.mjs"


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_node_devices_leave_and_come_back_as_themselves(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    fleet = BrowserFleet(web, DATA, port=0, devices=2, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=60)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    server = FleetServer(GlobalModel(exported), strategy, rounds=3, directory=tmp_path / "rounds")
    with fleet:
        driver = run_beside_node(fleet, server, DRIVER, fleet.url, ort_web_dist())
    assert driver.process.returncode == 0, driver.stdout + driver.stderr
    kinds = [(event.device, event.kind) for event in fleet.hub.events]
    assert kinds == [*sorted([("a", "joined"), ("b", "joined")], key=kinds.index), ("b", "left"), ("b", "came back")]
    partitions = {e.device: e.detail for e in fleet.hub.events if e.kind in ("joined", "came back")}
    assert partitions["b"] == next(e.detail for e in fleet.hub.events if e.kind == "joined" and e.device == "b")
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 2), (2, 1), (3, 2)]
    # b left on purpose: round 2 records it as a device that left, not one that failed
    assert fleet.refusals == []
    assert [(r.failures, list(r.left.values())) for r in server.history] == [
        ({}, []), ({}, ["b pressed its leave button"]), ({}, [])]
    a_partition = int(partitions["a"].split()[1])
    expected = reference_rounds(web.directory, initial_values(exported), [[0, 1], [a_partition], [0, 1]], partitions=2)
    for record, average in zip(server.history, expected, strict=True):
        assert_round(record.checkpoint, average, atol=BROWSER_ATOL)
