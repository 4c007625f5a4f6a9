"""A Node device trains a model whose train frame is over 4 MiB (Node 20's WebSocket drops such a deflated message).

Node 20's WebSocket (undici 6.24) closes the connection (1006) on a per-message-deflated message that
inflates past 4 MiB: every train frame of a model over a million values (the LoRA example's Llama
has 5.8 M). The fleet serves its WebSocket without deflate, so the device trains its round; its
weights are compared with the same step in plain torch (SGD-like AdamW's first step: ``lr * sign``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import export_artifacts
from tests._web import ROOT, ort_web_dist
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.export import prepare_for_web  # noqa: E402
from ort_lightning.fleet import BrowserFleet, ClientData, FleetServer, GlobalModel  # noqa: E402

NODE_DEVICE = ROOT / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"
FEATURES, CLASSES, LR = 1100, 1000, 0.01  # 1.1 M values: a 4.4 MB frame each way


def _data(partition: int, partitions: int) -> ClientData:
    x = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(partition))
    return ClientData(train=DataLoader(TensorDataset(x, torch.arange(4)), batch_size=4))


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_node_device_trains_a_model_over_four_mebibytes(tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    exported = export_artifacts(model, torch.zeros(2, FEATURES), tmp_path / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    web = prepare_for_web(exported, tmp_path / "web", lr=LR)
    fleet = BrowserFleet(web, _data, port=0, devices=1, device_timeout=120, ort_web=ort_web_dist(), wait_timeout=60)
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=1)
    server = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=tmp_path / "rounds")
    with fleet:
        device = subprocess.Popen([node, "--experimental-websocket", str(NODE_DEVICE), fleet.url, "--ort-web",
                                   str(ort_web_dist())], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        try:
            fleet.run(server, join_timeout=90)
        finally:
            fleet.close()
            output, _ = device.communicate(timeout=60)
    assert [(r.devices, r.failures) for r in server.history] == [(1, {})], output
    # one AdamW step from fresh moments moves each weight by lr * sign(gradient) (torch's, less decay)
    x, y = next(iter(_data(0, 1).train))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        expected = model.weight * (1 - LR * 0.01) - LR * model.weight.grad / (model.weight.grad.abs() + 1e-8)
    trained = GlobalModel(exported, checkpoint=server.history[0].checkpoint).arrays().to_torch_state_dict()["weight"]
    # NOTE: where a gradient is near AdamW's epsilon, runtimes differ by up to the rate (docs/fleets.md): left out.
    clear = model.weight.grad.abs() > 1e-5
    assert clear.float().mean() > 0.9
    torch.testing.assert_close(trained[clear], expected[clear], atol=2e-5, rtol=0)
