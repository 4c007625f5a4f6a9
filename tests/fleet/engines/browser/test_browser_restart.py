"""A browser fleet's server restarted during a run: no finished round is lost, and the devices come back.

Two Node devices (``node_device.mjs``'s ``stayInFleet``, which reconnects as the page does) train a
4-round run. Once round 2's checkpoint is on disk the server goes away (`BrowserFleet.close`, as a
stopped process closes its sockets); its run ends with `FleetError` once no device is left. The
user starts it again on the same port with the same token, resuming from the last round
checkpoint (``GlobalModel(checkpoint=...)``, the fleet config's ``resume``): the devices join it
again on their own, and the run finishes rounds 3 and 4; then both are told that the run finished
(close code 4000) and stop trying to join. Every round checkpoint 1-4 is there, and
each resumed round equals the float64 FedAvg of ONNX Runtime's Python loop over the replies it used,
from the round before.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import ROOT, node_beside, ort_web_dist
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.errors import FleetError  # noqa: E402
from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from tests.fleet.engines.browser.digits_rounds import BROWSER_ATOL, DATA, LR, assert_round, checkpoint_values  # noqa: E402

DRIVER = ROOT / "tests" / "web" / "node_stay.mjs"
TOKEN = "the-same-token-after-a-restart"
ROUNDS = 4


def _server(exported: TrainingArtifacts, folder: Path, checkpoint: Path | None = None) -> FleetServer:
    model = GlobalModel(exported, checkpoint=checkpoint)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    return FleetServer(model, strategy, rounds=ROUNDS - model.server_round, directory=folder)


def _fleet(web: TrainingArtifacts, port: int) -> BrowserFleet:
    return BrowserFleet(web, DATA, port=port, devices=2, device_timeout=60, ort_web=ort_web_dist(), token=TOKEN,
                        wait_timeout=3)


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_server_restarted_with_the_same_token_loses_no_round_and_its_devices_come_back(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    rounds = tmp_path / "rounds"
    first = _fleet(web, 0)
    port = first.port
    stopped: list[BaseException] = []

    def run_until_stopped() -> None:
        try:
            first.run(_server(exported, rounds), join_timeout=60)
        except FleetError as error:
            stopped.append(error)

    with node_beside(DRIVER, first.url, ort_web_dist()) as driver:
        with first:
            runner = threading.Thread(target=run_until_stopped)
            runner.start()
            end = time.monotonic() + 90
            while not (rounds / "round-0002.ortckpt").exists() and time.monotonic() < end:
                time.sleep(0.01)
        runner.join(timeout=60)
        assert stopped, "the first run should stop once its server went away"
        finished = max(int(path.stem.split("-")[1]) for path in rounds.glob("round-*.ortckpt"))
        last = rounds / f"round-{finished:04d}.ortckpt"
        server = _server(exported, rounds, checkpoint=last)
        with _fleet(web, port) as second:
            second.run(server, join_timeout=60)
    output = driver.stdout + driver.stderr
    assert driver.process.returncode == 0, output
    assert driver.stdout.strip().splitlines()[-1] == "[4000,4000]", output
    assert 2 <= finished < ROUNDS
    assert sorted(path.name for path in rounds.glob("round-*.ortckpt")) == [
        f"round-{n:04d}.ortckpt" for n in range(1, ROUNDS + 1)]
    assert [record.server_round for record in server.history] == list(range(finished + 1, ROUNDS + 1))
    assert sorted((e.device, e.kind) for e in second.hub.events if e.kind == "joined") == [("a", "joined"),
                                                                                          ("b", "joined")]
    start = checkpoint_values(last)
    receipts = second.hub.ledger.receipts
    for record in server.history:
        used = sorted(r.partition for r in receipts if r.server_round == record.server_round and r.outcome == "used")
        assert used == [0, 1]
        loaders = {p: DATA(p, 2).train for p in used}
        fits = [(ort_device_loop(web.directory, list(loaders[p]), lr=LR, graphs="ort", values=start),
                 len(loaders[p].dataset)) for p in used]  # type: ignore[arg-type]
        total = sum(count for _, count in fits)
        average = {n: sum(values[n].astype(np.float64) * count for values, count in fits) / total for n in start}
        assert_round(record.checkpoint, average, atol=BROWSER_ATOL)
        start = checkpoint_values(record.checkpoint)  # type: ignore[arg-type]
