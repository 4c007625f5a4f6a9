"""Bad inputs that ONNX Runtime would accept silently (or die on), each refused with a clear error.

The whole catalog, with the tests of the cases covered elsewhere, is in docs/errors.md.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule, TrainingArtifacts
from ort_lightning.artifacts import MANIFEST_NAME
from ort_lightning.errors import ArtifactError, BatchError, CheckpointError, ConfigurationError
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, max_epochs=1, accelerator="cpu")


def _loader(labels: torch.Tensor | None = None, n: int = 16) -> DataLoader:
    x, y = blobs(n, seed=4)
    return DataLoader(TensorDataset(x, y if labels is None else labels), batch_size=8)


def _copy(exported: Exported, tmp_path: Path) -> Path:
    folder = tmp_path / "artifacts"
    shutil.copytree(exported.artifacts.directory, folder)
    return folder


# ----------------------------------------------------------------------------- labels out of range
# NOTE: -100 is torch's default ignore_index, which loss="cross_entropy" follows: it is accepted.
@pytest.mark.parametrize(("bad", "found"), [(3, r"\[0, 3\]"), (100, r"\[0, 100\]"), (-1, r"\[-1, 2\]"),
                                            (-101, r"\[-101, 2\]")], ids=["3", "100", "-1", "-101"])
def test_labels_out_of_range_are_refused(mlp_adamw: Exported, bad: int, found: str) -> None:
    labels = torch.tensor([0, 1, 2] * 5 + [bad])
    module = ORTLightningModule(mlp_adamw.artifacts)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    message = r"Labels 'labels' of the training graph must be class indices in \[0, 3\).*, but the batch has values"
    message += rf" in {found}"
    with pytest.raises(BatchError, match=message + r".*check_labels=False"):
        _trainer().fit(module, _loader(labels))
    # the first batch (labels 0..2) trained; the bad second one never reached ORT's update
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in module.named_parameters())


def test_labels_out_of_range_are_refused_in_validation(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(BatchError, match=r"Labels 'labels' of the eval graph must be class indices in \[0, 3\)"):
        _trainer().validate(module, _loader(torch.full((16,), 7)))


def test_label_check_can_be_turned_off(mlp_adamw: Exported) -> None:
    # NOTE: ORT indexes its log-probabilities at row * classes + label without a bound check, so label 3 on
    # the first row reads the second row's class 0: a defined (wrong) loss, which is why the check exists.
    # A label past the buffer's end would read memory ORT does not own (a NaN one run in a few).
    labels = torch.tensor([3, 0, 1, 2, 0, 1, 2, 0] * 2)
    x = _loader(labels).dataset.tensors[0][:8]
    with torch.no_grad():
        flat = torch.log_softmax(mlp_adamw.reference()(x), dim=1).flatten()
    expected = -flat[torch.arange(8) * 3 + labels[:8]].mean()
    module = ORTLightningModule(mlp_adamw.artifacts, check_labels=False)
    trainer = _trainer(max_steps=1)
    trainer.fit(module, _loader(labels))
    torch.testing.assert_close(trainer.callback_metrics["train_loss"], expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- empty batches
def test_empty_batch_is_refused(mlp_adamw: Exported) -> None:
    # NOTE: without this check ONNX Runtime 1.19.2 kills the process with SIGFPE.
    empty = [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))]
    module = ORTLightningModule(mlp_adamw.artifacts)
    message = r"Input 'input' of the training graph is empty \(shape \(0, 4\), 0 elements\).*drop_last=True"
    with pytest.raises(BatchError, match=message):
        _trainer().fit(module, DataLoader(empty, batch_size=None))


def test_empty_input_to_forward_is_refused(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(BatchError, match=r"Input 'input' of the eval graph is empty"):
        module(torch.zeros(0, 4))


# ----------------------------------------------------------------------------- artifacts folder
def test_manifest_of_another_model_is_refused(mlp_adamw: Exported, bn_dropout_cnn: Exported, tmp_path: Path) -> None:
    folder = _copy(mlp_adamw, tmp_path)
    shutil.copy(bn_dropout_cnn.artifacts.directory / MANIFEST_NAME, folder / MANIFEST_NAME)
    message = (
        r"describes the inputs \[input: float32\['batch', 1, 8, 8\], labels: int64\['batch'\]\], but "
        r"training_model\.onnx takes \[input: float32\['batch', 4\], labels: int64\['batch'\]\]; the manifest "
        r"belongs to another model"
    )
    with pytest.raises(ArtifactError, match=message):
        ORTLightningModule(folder)


def test_manifest_with_renamed_inputs_is_refused(mlp_adamw: Exported, tmp_path: Path) -> None:
    folder = _copy(mlp_adamw, tmp_path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["inputs"][0]["name"] = "pixels"
    manifest["labels"][0]["dtype"] = "int32"
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    message = r"describes the inputs \[pixels: float32\['batch', 4\], labels: int32\['batch'\]\], but .* takes \[input:"
    with pytest.raises(ArtifactError, match=message):
        ORTLightningModule(folder)


def test_extra_files_in_the_artifacts_folder_are_ignored(mlp_adamw: Exported, tmp_path: Path) -> None:
    folder = _copy(mlp_adamw, tmp_path)
    (folder / "model.onnx").write_bytes(b"not an onnx graph")  # a stray graph
    (folder / "manifest.json").write_text('{"format": "something else"}')  # a second manifest-like file
    (folder / "libcustom_ops.so").write_bytes(b"\x00" * 64)  # never loaded unless named
    (folder / "notes.txt").write_text("exported on Monday")
    artifacts = TrainingArtifacts.load(folder)
    module = ORTLightningModule(artifacts)
    _trainer(max_steps=2).fit(module, _loader())
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


# ----------------------------------------------------------------------------- custom operator library
def test_missing_custom_op_library_is_refused(mlp_adamw: Exported, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"custom_op_library '.*missing\.so' does not exist.*or None"):
        ORTLightningModule(mlp_adamw.artifacts, custom_op_library=tmp_path / "missing.so")


def test_custom_op_library_that_is_not_a_library_is_refused(mlp_adamw: Exported, tmp_path: Path) -> None:
    library = tmp_path / "ops.so"
    library.write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigurationError, match=r"ONNX Runtime cannot load custom_op_library .*ops\.so.*1\.19\.2"):
        ORTLightningModule(mlp_adamw.artifacts, custom_op_library=library)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("under", ["a-file", "the-file-itself"], ids=str)
def test_unwritable_checkpoint_folder_is_refused_before_training(
    mlp_adamw: Exported, tmp_path: Path, under: str
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    dirpath = blocker / "checkpoints" if under == "a-file" else blocker
    module = ORTLightningModule(mlp_adamw.artifacts)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    trainer = _trainer(callbacks=[ORTCheckpoint(dirpath)], enable_checkpointing=True)
    with pytest.raises(CheckpointError, match=r"Cannot write checkpoints to .*blocker.*pass another `dirpath`"):
        trainer.fit(module, _loader())
    assert trainer.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())


def _plain(value: object) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def test_model_checkpoint_file_holds_only_tensors_and_plain_types(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, on_nonfinite="skip")
    callback = ModelCheckpoint(dirpath=tmp_path, filename="model")
    _trainer(max_epochs=1, enable_checkpointing=True, callbacks=[callback]).fit(module, _loader())
    checkpoint = torch.load(callback.best_model_path, weights_only=True)
    assert _plain(checkpoint)
    assert checkpoint["ort_state"].dtype is torch.uint8
    assert checkpoint["hyper_parameters"]["on_nonfinite"] == "skip"
    assert checkpoint["hyper_parameters"]["custom_op_library"] is None


# ----------------------------------------------------------------------------- learning rate and schedule
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, r"`lr` to be a positive float, but got 0\.0; pass the peak learning rate"),
        ({"lr": -1e-3}, r"`lr` to be a positive float, but got -0\.001"),
        ({"total_steps": 0}, r"`total_steps` to be a positive int or None, but got 0; pass None"),
        ({"warmup_steps": 1.5}, r"`warmup_steps` as a count .* or a fraction in \(0, 1\), but got 1\.5; pass e\.g\."),
        ({"warmup_steps": -1}, r"`warmup_steps` >= 0, but got -1; pass 0 for no warmup"),
    ],
    ids=["zero-lr", "negative-lr", "zero-total", "fractional-warmup-above-1", "negative-warmup"],
)
def test_bad_lr_or_schedule_is_refused(mlp_adamw: Exported, options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ORTLightningModule(mlp_adamw.artifacts, **options)  # type: ignore[arg-type]


def test_a_resumed_fit_past_the_end_of_its_schedule_is_refused_before_training(
    mlp_adamw: Exported, tmp_path: Path
) -> None:
    # A finished run (2 steps of a 2-step schedule) resumed with checkpoint= for more: every step would be at lr 0.
    _trainer(callbacks=[ORTCheckpoint(tmp_path)]).fit(ORTLightningModule(mlp_adamw.artifacts, lr=0.1), _loader())
    resumed = ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "last.ortckpt")
    before = {name: p.detach().clone() for name, p in resumed.named_parameters()}
    message = (r"linear lr schedule is over before this fit starts: it is at optimizer step 2 and reaches lr 0 at "
               r"total_steps=2 .* pass total_steps larger than 2 .* lr_scheduler='constant'")
    with pytest.raises(ConfigurationError, match=message):
        _trainer().fit(resumed, _loader())
    assert all(torch.equal(p.detach(), before[name]) for name, p in resumed.named_parameters())
    # What the message says works: a longer schedule continues from step 2 and trains.
    longer = ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "last.ortckpt", total_steps=4)
    _trainer().fit(longer, _loader())
    assert not torch.equal(longer.get_parameter("fc1.weight").detach(), before["fc1.weight"])


