"""Back out to transformers and peft, and in from them: ``save_pretrained`` against torch + peft's own loading.

A tiny Llama is trained under a real Trainer, once with a peft LoRA adapter and once as a full
fine-tune with tied embeddings. What comes back out (from the module, an ``ORTCheckpoint`` file, a
Lightning ``.ckpt``, the console script, the callback's folder) is loaded by peft and transformers
themselves, and their torch logits are compared with the eval graph's logits of the trained module.
The other way, folders saved by peft and transformers start a fine-tune whose first step equals
torch's on the loaded model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from ort_lightning import ORTCheckpoint, ORTLightningModule, TrainingArtifacts, export_artifacts, save_pretrained
from ort_lightning.cli.console import main
from ort_lightning.errors import ArtifactError, CheckpointError, ConfigurationError
from tests.decoders import decoder, token_batch
from tests.helpers import quiet_trainer
from tests.step_reference import assert_gradients_close, ort_steps, torch_step

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

STEPS = 3
#: The write-back's logits against the trained module's eval graph: largest difference over largest |logit|.
TOLERANCE = 1e-5
#: Adapters in attention and MLP, and a trained copy of the LM head (peft keeps the original beside it, unread).
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
            modules_to_save=["lm_head"])


@dataclass(frozen=True)
class Run:
    """A fine-tune trained for `STEPS` steps, and every form its result takes."""

    artifacts: TrainingArtifacts
    module: ORTLightningModule
    ortckpt: Path
    ckpt: Path
    callback_folder: Path
    batch: dict[str, torch.Tensor]
    logits: torch.Tensor  # the trained module's eval graph
    untrained: torch.Tensor  # the exported model's torch logits, before training


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max())


def _train(model: torch.nn.Module, root: Path) -> Run:
    batch = token_batch(padding="right")
    untrained = _logits(model, batch)
    artifacts = export_artifacts(model.train(), batch, root / "artifacts", loss=None, verify=False)
    module = ORTLightningModule(artifacts, lr=1e-2, lr_scheduler="constant")
    ort = ORTCheckpoint(root / "ort", every_n_train_steps=STEPS, save_last=False, pretrained=True)
    lightning = ModelCheckpoint(root / "lightning", every_n_train_steps=STEPS, save_last=False)
    quiet_trainer(max_steps=STEPS, callbacks=[ort, lightning]).fit(module, DataLoader([batch] * STEPS, batch_size=None))
    assert ort.best_path is not None
    logits = module(batch["input_ids"], batch["attention_mask"], batch["labels"])
    return Run(artifacts, module, ort.best_path, Path(lightning.best_model_path),
               ort.best_path.with_name(f"{ort.best_path.stem}-pretrained"), batch, logits, untrained)


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Run:
    model = peft.get_peft_model(decoder("llama", seed=0), peft.LoraConfig(**LORA))
    return _train(model, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _train(decoder("llama", tied=True, seed=1), tmp_path_factory.mktemp("full"))


def _written(run: Run, source: str, out: Path, *, merge: bool = False) -> Path:
    """The folder `source` gives: the module, an ORT checkpoint file, a .ckpt, the console script, the callback."""
    if source == "module":
        return run.module.save_pretrained(out, merge=merge)
    if source == "ortckpt":
        return save_pretrained(run.ortckpt, out, artifacts=run.artifacts.directory, merge=merge)
    if source == "ckpt":
        return save_pretrained(run.ckpt, out, merge=merge)
    if source == "cli":
        args = ["save-pretrained", str(run.ortckpt), "--artifacts", str(run.artifacts.directory), "--out", str(out)]
        assert main([*args, *(["--merge"] if merge else [])]) == 0
        return out
    assert source == "callback"
    assert not merge
    return run.callback_folder


SOURCES = ("module", "ortckpt", "ckpt", "cli", "callback")


# ----------------------------------------------------------------------------- out: LoRA
@pytest.mark.parametrize("source", SOURCES)
def test_a_lora_fine_tune_comes_back_as_the_adapter_folder_peft_loads(lora: Run, source: str, tmp_path: Path) -> None:
    folder = _written(lora, source, tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {path.name for path in folder.iterdir()}
    # peft's own loading, over the base the adapters were trained on (its seed), computes the reference in torch.
    loaded = peft.PeftModel.from_pretrained(decoder("llama", seed=0), folder)
    assert _relative(_logits(loaded, lora.batch), lora.logits) < TOLERANCE
    assert _relative(lora.untrained, lora.logits) > 100 * TOLERANCE  # the adapters trained: the check can fail


@pytest.mark.parametrize("source", ["module", "cli"])
def test_merged_lora_weights_load_as_a_transformers_model(lora: Run, source: str, tmp_path: Path) -> None:
    folder = _written(lora, source, tmp_path / "merged", merge=True)
    assert not (folder / "adapter_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert not any("lora" in name for name, _ in loaded.named_parameters())
    assert _relative(_logits(loaded, lora.batch), lora.logits) < TOLERANCE


# ----------------------------------------------------------------------------- out: full fine-tune
@pytest.mark.parametrize("source", SOURCES)
def test_a_full_fine_tune_comes_back_as_the_folder_transformers_loads(full: Run, source: str, tmp_path: Path) -> None:
    folder = _written(full, source, tmp_path / "model")
    assert {"model.safetensors", "config.json"} <= {path.name for path in folder.iterdir()}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied, as trained (one tensor in ORT)
    assert _relative(_logits(loaded, full.batch), full.logits) < TOLERANCE
    assert _relative(full.untrained, full.logits) > 100 * TOLERANCE


# ----------------------------------------------------------------------------- in: folders start a fine-tune
def _first_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], folder: Path) -> None:
    """Export `model`, train one step under a Trainer; loss and gradients equal torch's on `model`."""
    artifacts = export_artifacts(model, batch, folder, loss=None, verify=False)
    losses, grads, _ = ort_steps(artifacts, batch)
    loss, reference = torch_step(model, lambda m: m(**batch).loss)
    assert losses[0] == pytest.approx(loss, rel=1e-5)
    assert_gradients_close(grads, reference, rtol=1e-3, atol=1e-5)


def test_a_peft_adapter_folder_saved_from_torch_starts_a_fine_tune(tmp_path: Path) -> None:
    config = peft.LoraConfig(**LORA, init_lora_weights=False)  # non-zero adapters: their values matter
    peft.get_peft_model(decoder("llama", seed=2), config).save_pretrained(tmp_path / "adapter")
    model = peft.PeftModel.from_pretrained(decoder("llama", seed=2), tmp_path / "adapter", is_trainable=True)
    batch = token_batch(padding="left", seed=1)
    _first_step(model, batch, tmp_path / "artifacts")
    trainable = TrainingArtifacts.load(tmp_path / "artifacts").manifest.trainable
    assert trainable
    assert all("lora_" in name or "modules_to_save" in name for name in trainable)


def test_a_written_full_fine_tune_starts_the_next_one(full: Run, tmp_path: Path) -> None:
    folder = full.module.save_pretrained(tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    _first_step(model.train(), token_batch(padding="left", seed=1), tmp_path / "artifacts")


def test_an_export_over_a_transformers_folder_replaces_or_drops_its_record(full: Run, tmp_path: Path) -> None:
    shutil.copytree(full.artifacts.directory, tmp_path / "artifacts")
    config = json.loads((tmp_path / "artifacts" / "pretrained" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tmp_path / "artifacts", verify=False)
    assert not (tmp_path / "artifacts" / "pretrained").exists()  # a stale record would rebuild the wrong model


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def linear(tmp_path_factory: pytest.TempPathFactory) -> TrainingArtifacts:
    folder = tmp_path_factory.mktemp("linear")
    return export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder, verify=False, nominal_checkpoint=True)


def test_artifacts_of_another_model_are_refused_with_the_way_out(linear: TrainingArtifacts, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"records no transformers model .* pass the torch model the artifacts were "
                                            r"exported from: save_pretrained\(source, folder, model=model\)"):
        save_pretrained(ORTLightningModule(linear), tmp_path / "out")
    with pytest.raises(ConfigurationError, match=r"Expected `model` to be a transformers PreTrainedModel or a peft "
                                                 r"PeftModel \(something with save_pretrained\), but got Linear"):
        save_pretrained(linear.directory, tmp_path / "out", model=torch.nn.Linear(4, 3))
    assert not (tmp_path / "out").exists()


def test_a_nominal_checkpoint_is_refused(linear: TrainingArtifacts, tmp_path: Path) -> None:
    assert linear.nominal_checkpoint is not None
    with pytest.raises(CheckpointError, match="is a nominal checkpoint .* no trained values to write back"):
        save_pretrained(linear.nominal_checkpoint, tmp_path / "out", artifacts=linear.directory)


def test_sources_that_cannot_be_read_are_refused(lora: Run, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"is an ORT checkpoint file, which does not name the artifacts it "
                                                 r"was trained on; pass them"):
        save_pretrained(lora.ortckpt, tmp_path / "out")
    with pytest.raises(ConfigurationError, match=r"Expected the source to be an ORTLightningModule or the path of an "
                                                 r"ORT checkpoint file, .* but got 'missing.ckpt'"):
        save_pretrained("missing.ckpt", tmp_path / "out")
    with pytest.raises(ArtifactError, match="holds no training_model.onnx .* so it is not a training artifacts folder"):
        save_pretrained(tmp_path, tmp_path / "out")  # a folder, but no artifacts folder
    with pytest.raises(ConfigurationError, match="the source is a module, which trains .* already; leave artifacts="):
        save_pretrained(lora.module, tmp_path / "out", artifacts=lora.artifacts.directory)
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(CheckpointError, match="holds no ORT state .* pass a .ckpt that an ORTLightningModule saved"):
        save_pretrained(tmp_path / "plain.ckpt", tmp_path / "out")
    torch.save({"ort_state": torch.zeros(4, dtype=torch.uint8)}, tmp_path / "bare.ckpt")
    with pytest.raises(CheckpointError, match="names no artifacts folder; pass artifacts="):
        save_pretrained(tmp_path / "bare.ckpt", tmp_path / "out")


def test_a_model_that_does_not_fit_the_values_is_refused(full: Run, lora: Run, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"does not fit the LlamaForCausalLM .* names it has no tensor for "
                                              r"\['base_model.model"):
        save_pretrained(lora.module, tmp_path / "out", model=decoder("llama"))
    # the tied weight is one tensor in ORT's state: an untied model has a parameter left without a value
    with pytest.raises(CheckpointError, match=r"holds no value for the parameters \['lm_head.weight'\]"):
        save_pretrained(full.module, tmp_path / "out", model=decoder("llama", tied=False, seed=1))


def test_a_damaged_or_foreign_record_is_refused(full: Run, tmp_path: Path) -> None:
    folder = tmp_path / "artifacts"
    shutil.copytree(full.artifacts.directory, folder)
    record = folder / "pretrained" / "ort_lightning_pretrained.json"
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "model_class": "transformers.NoSuchModelForCausalLM"}))
    with pytest.raises(ArtifactError, match="NoSuchModelForCausalLM recorded in .* cannot be imported here"):
        save_pretrained(folder, tmp_path / "out")
    record.write_text("{not json")
    with pytest.raises(ArtifactError, match="is not a record of a transformers model that this version"):
        save_pretrained(folder, tmp_path / "out")


def test_the_callback_refuses_artifacts_without_a_record_before_training(
    linear: TrainingArtifacts, tmp_path: Path
) -> None:
    callback = ORTCheckpoint(tmp_path, pretrained=True)
    trainer = quiet_trainer(max_steps=1, callbacks=[callback])
    loader = DataLoader([(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))], batch_size=None)
    with pytest.raises(ConfigurationError, match=r"ORTCheckpoint\(pretrained=True\) writes .* records no transformers "
                                                 "model to rebuild .* or leave pretrained= out"):
        trainer.fit(ORTLightningModule(linear), loader)
    assert not list(tmp_path.glob("*.ortckpt"))


def test_the_active_one_of_two_adapters_comes_back_from_the_artifacts_folder(tmp_path: Path) -> None:
    # NOTE: non-zero adapters straight from the export: the rebuild draws other random values, so equal logits
    # mean the folder's values are the exported ones.
    model = peft.get_peft_model(decoder("llama", seed=3), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                         init_lora_weights=False), adapter_name="first")
    model.add_adapter("second", peft.LoraConfig(r=4, target_modules=["v_proj", "down_proj"], init_lora_weights=False))
    model.set_adapter("second")
    batch = token_batch(padding="left", seed=2)
    expected = _logits(model, batch)
    artifacts = export_artifacts(model.train(), batch, tmp_path / "artifacts", loss=None, verify=False)
    assert all(".second." in name for name in artifacts.manifest.trainable)
    folder = save_pretrained(artifacts.directory, tmp_path / "adapter")
    assert sorted(path.name for path in folder.iterdir()) == ["README.md", "second"]  # peft's layout for a named one
    loaded = peft.PeftModel.from_pretrained(decoder("llama", seed=3), folder / "second", adapter_name="second")
    assert _relative(_logits(loaded, batch), expected) < TOLERANCE
    assert _relative(_logits(decoder("llama", seed=3), batch), expected) > 100 * TOLERANCE


def test_inspect_names_what_save_pretrained_rebuilds(
    lora: Run, full: Run, linear: TrainingArtifacts, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = {}
    for name, folder in (("lora", lora.artifacts.directory), ("full", full.artifacts.directory),
                         ("linear", linear.directory)):
        assert main(["inspect", str(folder)]) == 0
        shown[name] = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pretrained:"))
    assert shown["lora"].endswith("LlamaForCausalLM with peft adapters default (active) (save-pretrained writes the "
                                  "active one)")
    assert shown["full"].endswith("LlamaForCausalLM (save-pretrained writes its transformers folder)")
    assert "not a transformers model" in shown["linear"]
