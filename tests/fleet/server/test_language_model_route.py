"""A language model in a fleet: its export input, its evaluation per token, its last round written back.

The global model's perplexity is compared with torch's own ``exp`` of the mean token cross-entropy
(transformers' loss over the same rows and weights); a classifier keeps its accuracy per sample.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import export_artifacts
from ort_lightning.errors import ConfigurationError
from tests.decoders import VOCAB, decoder

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
pytest.importorskip("transformers")

from ort_lightning.fleet import FleetConfig  # noqa: E402
from ort_lightning.fleet.config.fleet_config import ModelSection  # noqa: E402
from ort_lightning.fleet.server.global_model import GlobalModel  # noqa: E402
from ort_lightning.fleet.server.model_artifacts import example_inputs  # noqa: E402
from ort_lightning.fleet.server.pretrained_output import write_last_round  # noqa: E402

ROWS, LENGTH = 10, 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A tiny Llama and its artifacts, exported on its own loss from ``input_ids`` and ``labels``."""
    model = decoder("llama").eval()
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    folder = tmp_path_factory.mktemp("llama") / "artifacts"
    export_artifacts(model, {"input_ids": ids, "labels": ids}, folder, loss=None, nominal_checkpoint=True,
                     verify=False)
    return model, folder


def test_a_language_models_perplexity_is_torchs_exp_of_the_mean_token_cross_entropy(
    llama: tuple[torch.nn.Module, Path],
) -> None:
    model, folder = llama
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    for row, kept in ((1, 2), (4, 5), (5, 3), (9, 1)):  # right padding: the batches predict 22, 20 and 7 tokens
        labels[row, kept:] = -100
    result = GlobalModel(folder).evaluate(DataLoader(TensorDataset(ids, labels), batch_size=4))  # 4, 4, 2 rows
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=labels).loss)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert (result["tokens"], result["examples"]) == (int((labels[:, 1:] != -100).sum()), ROWS)
    assert "accuracy" not in result


def test_a_classifier_keeps_its_accuracy_per_sample(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(10, 4), torch.arange(10) % 3
    result = GlobalModel(export_artifacts(model, x[:2], tmp_path, verify=False)).evaluate(
        DataLoader(TensorDataset(x, y), batch_size=4))
    with torch.no_grad():
        expected = float((model(x).argmax(1) == y).float().mean())
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    assert result["accuracy"] == pytest.approx(expected)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    assert "perplexity" not in result


def test_the_example_input_is_the_datas_rows_by_name() -> None:
    ids = torch.arange(6).view(2, 3)
    own = ModelSection(factory="m:f", loss=None, input_names=["input_ids", "labels"])
    assert example_inputs(own, [ids, ids]) == {"input_ids": ids, "labels": ids}
    inputs = example_inputs(ModelSection(factory="m:f"), [ids.float(), torch.tensor([0, 1])])
    assert torch.equal(inputs, ids.float())  # a classifier's input: its rows, without the labels
    with pytest.raises(ConfigurationError, match=r"Expected `model.input_names` to name the 2 tensors the model takes "
                                                 r"from each batch \(inputs and labels\), but got \['input_ids'\]"):
        example_inputs(ModelSection(factory="m:f", loss=None, input_names=["input_ids"]), [ids, ids])


def test_the_last_round_is_written_only_when_a_round_was(tmp_path: Path) -> None:
    config = FleetConfig.from_dict({"output": {"folder": str(tmp_path), "pretrained": True}})
    with pytest.raises(ConfigurationError, match=r"`output.pretrained` writes the last round, but .*last.ortckpt was "
                                                 r"not written: no round aggregated any device"):
        write_last_round(config, tmp_path / "artifacts")
