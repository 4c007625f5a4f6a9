"""The federated LoRA fine-tune of examples/fleet_lora.yaml: a small Llama's adapters trained across topics.

The fast test runs the example's route end to end on a tiny config of it (3 devices, 2 rounds): the
perplexity falls, and the last round's adapter folder, loaded by transformers + peft
(``PeftModel.from_pretrained`` over the base the example's factory builds again), gives the logits
and loss of ONNX Runtime's eval graph on the last round's checkpoint, and the perplexity the fleet
printed. The slow test runs the README's config as written (10 devices, 5 rounds): a fifth off the perplexity.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ROOT

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ort_lightning import ORTLightningModule  # noqa: E402
from ort_lightning.fleet import FleetConfig, run_fleet  # noqa: E402

EXAMPLE = ROOT / "examples" / "fleet_lora.yaml"
sys.path.insert(0, str(EXAMPLE.parent))
from fleet_lora import TopicText, pretrained_llama  # noqa: E402

#: The example's config made tiny: a 0.1 M parameter Llama, 3 topics and devices, 2 rounds.
TINY_BASE = {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "vocabulary": 96,
             "topics": 3, "pretrain_steps": 10, "length": 16}
TINY_DATA = {"topics": 3, "train": 16, "held_out": 4, "length": 16}
TINY = [f"model.init_args={ {**TINY_BASE, 'rank': 4} }", f"data.init_args={TINY_DATA}", "rounds=2",
        "devices.count=3", "devices.batch_size=8", "devices.lr=0.02", "output.plot=false", "model.verify=false"]


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _run(tmp_path: Path, overrides: list[str]) -> tuple[dict[str, Any], Path]:
    config = FleetConfig.from_yaml(EXAMPLE, overrides=[*overrides, f"output.folder={tmp_path / 'run'}"])
    return run_fleet(config, search=[EXAMPLE.parent]), tmp_path / "run"


def _held_out(data: dict[str, Any]) -> torch.Tensor:
    module = TopicText(**data)
    module.setup()
    return module.sets["val"].tensors[0]


def _peft_model(base: dict[str, Any], folder: Path) -> Any:
    """The adapter folder over the base the example's factory pre-trains again (transformers + peft alone)."""
    return peft.PeftModel.from_pretrained(pretrained_llama(**base), folder).eval()


def test_the_lora_example_fine_tunes_and_writes_a_peft_adapter(tmp_path: Path) -> None:
    history, out = _run(tmp_path, TINY)
    perplexities = [history["initial"]["perplexity"]] + [r["perplexity"] for r in history["rounds"]]
    assert perplexities[-1] < perplexities[0]
    assert "accuracy" not in history["rounds"][-1]
    ids = _held_out(TINY_DATA)
    model = _peft_model(TINY_BASE, out / "pretrained")
    with torch.no_grad():
        reference = model(input_ids=ids, labels=ids)
    module = ORTLightningModule(out / "artifacts", checkpoint=out / "rounds" / "last.ortckpt")
    loss, logits = module.evaluate_batch([ids, ids])
    torch.testing.assert_close(logits, reference.logits, atol=1e-4, rtol=1e-4)
    assert float(loss) == pytest.approx(float(reference.loss), rel=1e-5)
    assert perplexities[-1] == pytest.approx(math.exp(float(reference.loss)), rel=1e-5)


@pytest.mark.slow
def test_the_readme_lora_example_lowers_perplexity_by_a_fifth(tmp_path: Path) -> None:
    history, out = _run(tmp_path, [])
    config = history["config"]
    assert (config["devices"]["count"], config["rounds"], len(history["rounds"])) == (10, 5, 5)
    assert all(r["devices"] == 10 for r in history["rounds"])
    first, last = history["initial"]["perplexity"], history["rounds"][-1]["perplexity"]
    assert last <= 0.8 * first, (first, last)
    # NOTE: the fast test compares the folder's logits with ORT's; here it loads over an untrained base (no second
    # pre-training), and its adapters are the last round's.
    base = {key: value for key, value in config["model"]["init_args"].items() if key != "rank"}
    model = _peft_model({**base, "pretrain_steps": 0}, out / "pretrained")
    adapters = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert len(adapters) == 4 * 2 * 2  # 4 layers, q_proj and v_proj, A and B
    assert all(p.abs().sum() > 0 for name, p in adapters.items() if "lora_B" in name)  # trained away from zero
