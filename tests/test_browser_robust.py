"""A poisoned web device against Flower's robust strategies: two honest Node devices, one that scales its update.

The poisoned device speaks the page's protocol from Python and answers every round with the
round's weights times 1e3 (finite: it passes every check the hub makes). Under FedMedian and
FedTrimmedAvg the global accuracy on the held-out digits still rises over 3 rounds; under FedAvg
the same device is visible in the round's numbers: the global weights' largest magnitude grows
by orders of magnitude and the accuracy stays near chance.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts

from ._web import ROOT, ort_web_dist
from .helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader  # noqa: E402
from ort_lightning.fleet.devices.frames import pack, unpack  # noqa: E402

from .test_browser_fleet import _checkpoint_values, digits_folders  # noqa: E402, F401

NODE_DEVICE = ROOT / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"
DATA = DigitsPartitions(batch_size=16, seed=0)


def _poisoned(fleet: BrowserFleet) -> None:
    """A device that answers each round with its weights scaled by 1e3, until the fleet closes."""
    url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + "&name=poisoned"
    with connect(url, max_size=None) as socket:
        json.loads(socket.recv())  # welcome
        socket.send(json.dumps({"type": "ready", "parameters": fleet.hub.parameters, "identity": "poisoned-0001"}))
        json.loads(socket.recv())  # admitted
        try:
            while True:
                header, payload = unpack(socket.recv())
                weights = np.frombuffer(payload[: 4 * fleet.hub.parameters], dtype=np.float32) * np.float32(1e3)
                socket.send(pack({"type": "result", "id": header["id"], "examples": header["examples"], "steps": 1,
                                  "losses": [1.0]}, [weights]))
        except ConnectionClosed:
            return


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
@pytest.mark.parametrize("strategy", [FedMedian, FedTrimmedAvg, FedAvg], ids=["median", "trimmed-mean", "fedavg"])
def test_a_poisoned_device_is_outvoted_by_robust_strategies_and_visible_under_fedavg(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path, strategy: type  # noqa: F811
) -> None:
    exported, web = digits_folders
    node = shutil.which("node")
    assert node is not None
    fleet = BrowserFleet(web, DATA, port=0, devices=3, device_timeout=60, ort_web=ort_web_dist())
    options = {"fraction_evaluate": 0.0, "min_available_nodes": 3, "min_train_nodes": 3}
    if strategy is FedTrimmedAvg:
        options["beta"] = 0.34  # one device of three cut at each end
    server = FleetServer(GlobalModel(exported), strategy(**options), rounds=3, directory=tmp_path / "rounds",
                         test=digits_test_loader(0))
    with fleet:
        honest = subprocess.Popen([node, "--experimental-websocket", str(NODE_DEVICE), fleet.url, "--ort-web",
                                   str(ort_web_dist()), "--devices", "2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.STDOUT)
        poisoned = threading.Thread(target=_poisoned, args=(fleet,), daemon=True)
        poisoned.start()
        try:
            fleet.run(server, join_timeout=90)
        finally:
            fleet.close()
            honest.wait(timeout=60)
    accuracies = [record.evaluation["accuracy"] for record in server.history]
    assert [record.devices for record in server.history] == [3, 3, 3]
    largest = float(max(np.abs(v).max() for v in _checkpoint_values(server.history[-1].checkpoint).values()))
    if strategy is FedAvg:
        assert largest > 1e3, largest
        assert accuracies[-1] < 0.5, accuracies
    else:
        assert largest < 10, largest
        assert accuracies[-1] > server.initial["accuracy"] + 0.3, (server.initial, accuracies)
