"""Flower's differential privacy over web devices (Node devices, the page's code), clipped on either side.

`DifferentialPrivacyClientSideFixedClipping` puts the clipping norm in each train message; the
device clips its own update (``device.js``'s ``clip``) before it replies.
`DifferentialPrivacyServerSideFixedClipping` clips each device's update on the server, before it
aggregates; the devices send their updates whole. With the noise off, the round's global update
is then the example-weighted mean of updates of norm at most the clipping norm, so its norm is at
most that norm, where the same round without a wrapper moves the weights more than ten times as far.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import NODE_DEVICE, ort_web_dist, run_beside_node
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import (  # noqa: E402
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)

from ort_lightning.fleet import (  # noqa: E402
    BrowserFleet,  # noqa: E402
    FleetServer,
    GlobalModel,
)
from tests.fleet.engines.browser.digits_rounds import DATA, checkpoint_values, initial_values  # noqa: E402

NORM = 0.05


def _update_norm(exported: TrainingArtifacts, web: TrainingArtifacts, folder: Path, *, dp: str | None) -> float:
    strategy: Strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    if dp is not None:
        wrapper = {"client": DifferentialPrivacyClientSideFixedClipping,
                   "server": DifferentialPrivacyServerSideFixedClipping}[dp]
        strategy = wrapper(strategy, noise_multiplier=0.0, clipping_norm=NORM, num_sampled_clients=2)
    server = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=folder)
    with BrowserFleet(web, DATA, port=0, devices=2, device_timeout=60, ort_web=ort_web_dist()) as fleet:
        run_beside_node(fleet, server, NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--devices", 2)
    assert [record.devices for record in server.history] == [2]
    start, end = initial_values(exported), checkpoint_values(server.history[0].checkpoint)
    return float(np.sqrt(sum(((end[n].astype(np.float64) - start[n]) ** 2).sum() for n in start)))


@pytest.fixture(scope="module")
def plain(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path_factory: pytest.TempPathFactory
) -> float:
    """The norm of the same round without a wrapper, run once for both sides."""
    exported, web = digits_folders
    return _update_norm(exported, web, tmp_path_factory.mktemp("plain"), dp=None)


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
@pytest.mark.parametrize("side", ["client", "server"], ids=["clipped-on-the-device", "clipped-on-the-server"])
def test_web_device_updates_are_clipped_to_the_norm(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], plain: float, tmp_path: Path, side: str
) -> None:
    exported, web = digits_folders
    clipped = _update_norm(exported, web, tmp_path / "dp", dp=side)
    assert 0 < clipped <= NORM * (1 + 1e-5), clipped
    assert plain > 10 * NORM, plain
