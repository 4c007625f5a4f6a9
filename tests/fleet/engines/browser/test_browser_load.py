"""The browser fleet under load: 50 Node devices over 10 rounds, 10 leaving and 5 coming back, on loopback.

``tests/web/node_load.mjs`` runs the devices (``node_device.mjs``: the page's FleetDevice and runner.js)
in one Node process. A seeded plan picks the 10 that leave, each at a moment of its own (a round, the
phase its status shows then: as it starts training, so that it owes the round, or a delay after it
sent its reply), and the 5 of them that join again after a delay, with the identity they kept. Checked:

- nothing lost: every result frame a device handed to its socket is on the server's ledger, in its
  round, either used (handed to the strategy) or refused by name, and nothing else is there;
- each round equals the example-weighted float64 FedAvg of ONNX Runtime's documented Python loop over
  the partitions whose replies it used, from the previous round's checkpoint;
- the server's memory is flat: its resident size in the last rounds stays within a few MB of round 2's.

Kept short (a 16-unit MLP, one batch of about 28 digits per device and round) so that it takes well
under a minute and a half on two busy cores; ``benchmarks/node_fleet.py`` times rounds against the
device count.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import ROOT, ort_web_dist, run_beside_node
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    LR,
    assert_round,
    checkpoint_values,
    initial_values,
)

DRIVER = ROOT / "tests" / "web" / "node_load.mjs"
DEVICES, ROUNDS, LEAVING, RETURNING = 50, 10, 10, 5
#: The most the server's resident memory may grow from round 2 to the last (MB): far below a leak of a round's
#: frames (50 devices x ~13 kB sent and received) kept every round.
FLAT_MB = 8.0


def _plan(seed: int) -> dict[str, object]:
    """Who leaves when (round 2 to 8, as it starts training or 0-200 ms after it sent), and who comes back when."""
    rng = random.Random(seed)
    names = [f"d{i:02d}" for i in range(1, DEVICES + 1)]
    leaving = rng.sample(names, LEAVING)
    returning = set(rng.sample(leaving, RETURNING))
    leaves = [{"device": name, "round": rng.randint(2, 8), "phase": rng.choice(["training", "sent"]),
               "delay": rng.randint(0, 200), "rejoin": rng.randint(100, 1500) if name in returning else None}
              for name in leaving]
    return {"devices": DEVICES, "leaves": leaves}


class _Resident:
    """Samples this process's resident memory every 50 ms, by the round the hub has reached."""

    def __init__(self, fleet: BrowserFleet) -> None:
        self.fleet, self.by_round = fleet, {}  # type: dict[int, float]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            rss = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                       if line.startswith("VmRSS:")) / 1024
            server_round = self.fleet.hub.server_round
            self.by_round[server_round] = max(self.by_round.get(server_round, 0.0), rss)

    def __enter__(self) -> _Resident:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_fifty_node_devices_ten_rounds_ten_leave_five_come_back_nothing_lost(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    plan = _plan(seed=39)
    fleet = BrowserFleet(web, DATA, port=0, devices=DEVICES, device_timeout=60, ort_web=ort_web_dist(),
                         wait_timeout=60)
    floor = DEVICES - LEAVING
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=floor, min_train_nodes=floor)
    server = FleetServer(GlobalModel(exported), strategy, rounds=ROUNDS, directory=tmp_path / "rounds")
    started = time.perf_counter()
    with fleet, _Resident(fleet) as resident:
        driver = run_beside_node(fleet, server, DRIVER, fleet.url, ort_web_dist(), json.dumps(plan), join_timeout=120)
    seconds = time.perf_counter() - started
    assert driver.process.returncode == 0, driver.stderr
    devices = json.loads(driver.stdout.splitlines()[-1])
    assert devices["errors"] == []
    assert sorted(devices["left"]) == sorted(leave["device"] for leave in plan["leaves"])  # type: ignore[union-attr]
    assert len(devices["rejoined"]) == RETURNING

    # nothing lost: each frame a device sent is on the ledger, in its round, used or refused by name
    receipts = fleet.hub.ledger.receipts
    assert sorted((r.device, r.server_round) for r in receipts) == sorted(map(tuple, devices["sent"]))
    assert {r.outcome for r in receipts} <= {"used", "refused"}
    assert all(r.reason for r in receipts if r.outcome == "refused")
    kinds = [event.kind for event in fleet.hub.events]
    assert (kinds.count("joined"), kinds.count("left"), kinds.count("came back")) == (DEVICES, LEAVING, RETURNING)
    assert [record.server_round for record in server.history] == list(range(1, ROUNDS + 1))

    # each round: FedAvg of ONNX Runtime's own loop over the partitions it used, from the round before
    start = initial_values(exported)
    for record in server.history:
        used = sorted(r.partition for r in receipts if r.server_round == record.server_round and r.outcome == "used")
        assert record.devices == len(used) >= floor, (record.server_round, record.devices, used)
        loaders = {p: DATA(p, DEVICES).train for p in used}
        fits = [(ort_device_loop(web.directory, list(loaders[p]), lr=LR, graphs="ort", values=start),
                 len(loaders[p].dataset)) for p in used]  # type: ignore[arg-type]
        total = sum(count for _, count in fits)
        average = {n: sum(values[n].astype(np.float64) * count for values, count in fits) / total for n in start}
        assert_round(record.checkpoint, average, atol=BROWSER_ATOL)
        start = checkpoint_values(record.checkpoint)  # type: ignore[arg-type]

    # the server's memory is flat, and the run is bounded in time
    growth = max(resident.by_round[r] for r in range(3, ROUNDS + 1)) - resident.by_round[2]
    assert growth < FLAT_MB, resident.by_round
    assert seconds < 150, seconds
    print(f"\n{DEVICES} Node devices, {ROUNDS} rounds in {seconds:.1f} s; devices by round "
          f"{[r.devices for r in server.history]}; failures {[len(r.failures) for r in server.history]}; round seconds "
          f"{[round(r.seconds, 2) for r in server.history]}; resident MB by round "
          f"{ {k: round(v, 1) for k, v in sorted(resident.by_round.items())} }")
