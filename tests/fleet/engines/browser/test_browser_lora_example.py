"""The LoRA example of examples/fleet_lora.yaml with Node devices (``node_device.mjs``), on a tiny config of it.

Three Node devices train the tiny Llama's adapters for 2 rounds through the browser engine (the
CLI's ``--browsers``): the perplexity falls, and the last round's adapter folder, loaded by
transformers + peft over the base the factory builds again, gives the perplexity the fleet printed.
"""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests._web import ROOT, free_port, node_devices_when_served, ort_web_dist
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from ort_lightning.fleet import FleetConfig, run_fleet  # noqa: E402

EXAMPLE = ROOT / "examples" / "fleet_lora.yaml"
NODE_DEVICE = ROOT / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"
sys.path.insert(0, str(EXAMPLE.parent))
from fleet_lora import TopicText, pretrained_llama  # noqa: E402

BASE = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocabulary": 96, "topics": 3,
        "pretrain_steps": 10, "length": 16}
DATA = {"topics": 3, "train": 16, "held_out": 4, "length": 16}
TOKEN = "lora-example"


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_node_devices_fine_tune_the_lora_example(tmp_path: Path) -> None:
    port = free_port()
    config = FleetConfig.from_yaml(EXAMPLE, overrides=[
        f"model.init_args={ {**BASE, 'rank': 4} }", f"data.init_args={DATA}", "rounds=2", "devices.count=3",
        "devices.batch_size=8", "devices.lr=0.02", "model.verify=false", "output.plot=false", "engine.name=browser",
        f"engine.port={port}", f"engine.token={TOKEN}", f"engine.ort_web={ort_web_dist()}",
        f"output.folder={tmp_path / 'run'}"])
    outputs: list[str] = []
    devices = threading.Thread(target=node_devices_when_served, args=(port, TOKEN, 3, outputs), daemon=True)
    devices.start()
    history = run_fleet(config, search=[EXAMPLE.parent], echo=False)
    devices.join(timeout=60)
    assert [r["devices"] for r in history["rounds"]] == [3, 3], outputs
    first, last = history["initial"]["perplexity"], history["rounds"][-1]["perplexity"]
    assert last < first
    module = TopicText(**DATA)
    module.setup()
    ids = module.sets["val"].tensors[0]
    model = peft.PeftModel.from_pretrained(pretrained_llama(**BASE), tmp_path / "run" / "pretrained").eval()
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert last == pytest.approx(math.exp(loss), rel=1e-5)
