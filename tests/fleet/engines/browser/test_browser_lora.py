"""Federated LoRA with a Chromium page and a Node device: the adapters travel, the base is read once, kept, never sent.

Each round equals the example-weighted float64 FedAvg of ONNX Runtime's documented Python loop per
device (`digits_rounds.reference_rounds`: every value copied into the nominal state), and the frozen
base in every round file is byte for byte the export's. Under SecAgg+, Node devices mask the adapters
alone, and the round is that FedAvg within the bound of tests/fleet/secure_bound.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import FEATURES, digits_mlp
from tests._web import ROOT, free_port, ort_web_dist, run_beside_node
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
peft = pytest.importorskip("peft", reason='peft is not installed: pip install -e ".[test]"')

from flwr.common import bytes_to_ndarray  # noqa: E402

from ort_lightning.fleet import BrowserFleet, GlobalModel  # noqa: E402
from ort_lightning.fleet.devices.frames import decode_record, unpack  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer  # noqa: E402
from tests.fleet.engines.browser.chromium import chromium  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    HIDDEN,
    LR,
    assert_round,
    checkpoint_values,
    fedavg_server,
    initial_values,
    reference_rounds,
)
from tests.fleet.secure_bound import fedavg, secagg_bound  # noqa: E402

NODE_DEVICE = ROOT / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"


@pytest.fixture(scope="module")
def lora_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The digits MLP with peft LoRA on both layers, exported once, and its device folder (lr 0.01)."""
    from ort_lightning.export import prepare_for_web

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights="gaussian")
    model = peft.get_peft_model(digits_mlp(HIDDEN, seed=0), config)
    root = tmp_path_factory.mktemp("browser-lora")
    exported = export_artifacts(model, torch.zeros(2, FEATURES), root / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "web", lr=LR)


@RunIf(node=True, chromium=True)
@pytest.mark.slow
@pytest.mark.spread
def test_a_page_and_a_node_device_exchange_only_the_adapters_and_the_page_keeps_the_base(
    lora_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = lora_folders
    node = shutil.which("node")
    assert node is not None
    port, profile = free_port(), tmp_path / "profile"  # the page's origin and storage, the same on its second visit
    fleet = BrowserFleet(web, DATA, port=port, devices=2, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=90)
    assert fleet.exchange.mode == "trainable"
    server = fedavg_server(exported, tmp_path / "rounds", devices=2, rounds=2)
    with fleet, chromium({"page": f"{fleet.url}&name=page"}, profile=profile):
        device = subprocess.Popen([node, "--experimental-websocket", str(NODE_DEVICE), fleet.url, "--ort-web",
                                   str(ort_web_dist()), "--name", "node"], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            fleet.run(server, join_timeout=90)
        finally:
            fleet.close()
            output, _ = device.communicate(timeout=60)
    assert device.returncode == 0, output
    assert fleet.refusals == []
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 2), (2, 2)]
    assert fleet.served["checkpoint"] == 2 * web.checkpoint.stat().st_size  # the complete one: each device, once
    start = initial_values(exported)
    adapters = sum(start[name].nbytes for name in exported.manifest.trainable)
    assert 3 * adapters < sum(value.nbytes for value in start.values())
    for record in server.history:  # the adapters and their .npy headers, nothing of the base
        assert adapters <= record.sent_bytes <= adapters + 128 * len(exported.manifest.trainable)
        assert record.received_bytes == record.sent_bytes
    partitions = {e.device: int(e.detail.split()[1]) for e in fleet.hub.events if e.kind == "joined"}
    order = [p for _, p in sorted(partitions.items())]
    expected = reference_rounds(web.directory, start, [order, order], partitions=2)
    for record, average in zip(server.history, expected, strict=True):
        assert_round(record.checkpoint, average, atol=BROWSER_ATOL)
        assert record.checkpoint is not None
        written = checkpoint_values(record.checkpoint)
        for name in exported.manifest.frozen:
            assert written[name].tobytes() == start[name].tobytes(), name
        assert any(not np.array_equal(written[name], start[name]) for name in exported.manifest.trainable)

    # The browser restarted on its profile, at the same origin: it trains from the files it stored, asking for none.
    again = BrowserFleet(web, DATA, port=port, devices=1, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=90)
    server = fedavg_server(exported, tmp_path / "rounds-again", devices=1, rounds=1)
    with again, chromium({"page": f"{again.url}&name=page"}, profile=profile):
        again.run(server, join_timeout=90)
    assert [(r.devices, again.refusals) for r in server.history] == [(1, [])]
    assert again.served == {}


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_node_devices_mask_only_the_adapters_under_secure_aggregation(
    lora_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    """Federated LoRA composes with SecAgg+ on the web: the masked vectors are the adapters', the base stays."""
    exported, web = lora_folders
    server = SecureFleetServer(GlobalModel(exported), rounds=1, directory=tmp_path / "rounds", devices=3,
                               secagg={"num_shares": 3, "reconstruction_threshold": 2, "timeout": 60})
    fleet = BrowserFleet(web, DATA, port=0, devices=3, device_timeout=60, ort_web=ort_web_dist(), wait_timeout=90)
    masked: list[list[np.ndarray]] = []
    receive = fleet.hub.receive

    def record(device: object, frame: object) -> None:
        if isinstance(frame, bytes):
            header, payload = unpack(frame)
            pairs = dict(decode_record(header.get("record"), payload, header.get("blobs"), device="node"))
            if "masked_params" in pairs:
                masked.append([bytes_to_ndarray(b) for b in pairs["masked_params"]])
        receive(device, frame)  # type: ignore[arg-type]

    fleet.hub.receive = record  # type: ignore[method-assign]
    with fleet:
        run = run_beside_node(fleet, server, NODE_DEVICE, fleet.url, "--ort-web", ort_web_dist(), "--devices", 3)
    assert run.process.returncode == 0, run.stderr
    assert [(r.devices, r.halted, r.failures) for r in server.history] == [(3, None, {})]
    start = initial_values(exported)
    trainable = exported.manifest.trainable
    assert len(masked) == 3
    for vectors in masked:  # the weight, then one vector per adapter: nothing of the frozen base
        assert sorted(v.shape for v in vectors[1:]) == sorted(start[name].shape for name in trainable)
    loaders = [DATA(p, 3).train for p in range(3)]
    fits = [ort_device_loop(web.directory, list(loader), lr=LR, graphs="ort", values=start) for loader in loaders]
    counts = [len(loader.dataset) for loader in loaders]  # type: ignore[arg-type]
    sent = [{name: fit[name] for name in trainable} for fit in fits]
    expected = fedavg(sent, counts)
    written = checkpoint_values(server.history[0].checkpoint)  # type: ignore[arg-type]
    limit = secagg_bound(sent, counts, expected) + BROWSER_ATOL
    worst = max(np.max(np.abs(written[n].astype(np.float64) - expected[n])) for n in trainable)
    assert 0 < worst <= limit, (worst, limit)
    for name in exported.manifest.frozen:
        assert written[name].tobytes() == start[name].tobytes(), name
