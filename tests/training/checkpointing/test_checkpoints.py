"""Checkpoints: ORT checkpoint files, exact resume both ways, damaged files, inference export."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import lightning as L
import numpy as np
import onnxruntime
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

import ort_lightning
from ort_lightning import ORTCheckpoint, ORTLightningModule
from ort_lightning.errors import CheckpointError, ConfigurationError
from ort_lightning.storage.atomic import atomic_write, digest_path, verify_digest
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

STEPS_PER_EPOCH = 8
SCHEDULE = dict(lr=0.05, warmup_steps=4, total_steps=2 * STEPS_PER_EPOCH)


def _trainer(root: Path, **options: object) -> L.Trainer:
    return quiet_trainer(**{"default_root_dir": root, **options})


def _loader() -> DataLoader:
    x, y = blobs(32 * STEPS_PER_EPOCH, seed=3)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def _val_loader() -> DataLoader:
    x, y = blobs(64, seed=4)
    return DataLoader(TensorDataset(x, y), batch_size=64)


def _weights(module: ORTLightningModule) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs by {(a[name] - b[name]).abs().max().item()}"


@pytest.fixture(scope="module")
def straight(mlp_adamw: Exported, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Parameters after two uninterrupted epochs (AdamW, ORT's linear warmup and decay)."""
    module = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    initial = _weights(module)
    _trainer(tmp_path_factory.mktemp("straight"), max_epochs=2).fit(module, _loader())
    weights = _weights(module)
    assert not torch.equal(initial["fc1.weight"], weights["fc1.weight"])
    return weights


# ----------------------------------------------------------------------------- exact resume
def test_resume_from_ort_checkpoint_file_is_bit_identical(mlp_adamw: Exported, straight, tmp_path: Path) -> None:
    first = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    _trainer(tmp_path, max_epochs=1, callbacks=[ORTCheckpoint(tmp_path / "ckpt")]).fit(first, _loader())
    resumed = ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "ckpt" / "last.ortckpt", **SCHEDULE)
    assert resumed.start_progress == {"global_step": STEPS_PER_EPOCH, "epoch": 1}  # its first epoch is epoch 1
    _trainer(tmp_path, max_epochs=1).fit(resumed, _loader())
    _assert_bit_identical(_weights(resumed), straight)


def test_resume_without_optimizer_state_is_not_exact(mlp_adamw: Exported, straight, tmp_path: Path) -> None:
    """The control of the test above: without the moments and the step, the run diverges."""
    first = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    callback = ORTCheckpoint(tmp_path, include_optimizer_state=False)
    _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(first, _loader())
    resumed = ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "last.ortckpt", **SCHEDULE)
    _trainer(tmp_path, max_epochs=1).fit(resumed, _loader())
    assert not torch.equal(_weights(resumed)["fc1.weight"], straight["fc1.weight"])


def test_resume_from_lightning_ckpt_is_bit_identical(mlp_adamw: Exported, straight, tmp_path: Path) -> None:
    first = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    _trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[saver]).fit(first, _loader())
    resumed = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    _trainer(tmp_path, max_epochs=2).fit(resumed, _loader(), ckpt_path=tmp_path / "last.ckpt")
    _assert_bit_identical(_weights(resumed), straight)


def test_lightning_ckpt_loads_weights_only_and_holds_ort_state(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(module, _loader())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    checkpoint = torch.load(tmp_path / "model.ckpt", weights_only=True)
    assert checkpoint["ort_state"].dtype is torch.uint8
    assert checkpoint["lr_schedulers"][0] == {"warmup_steps": 4, "total_steps": 16, "base_lr": 0.05, "step": 3}
    (tmp_path / "state").write_bytes(checkpoint["ort_state"].numpy().tobytes())
    state = CheckpointState.load_checkpoint(tmp_path / "state")
    np.testing.assert_array_equal(state.parameters["fc1.weight"].data, module.fc1.weight.detach().numpy())
    loaded = ORTLightningModule.load_from_checkpoint(tmp_path / "model.ckpt")
    _assert_bit_identical(_weights(loaded), _weights(module))


def test_state_dict_round_trip_writes_into_ort(mlp_adamw: Exported, tmp_path: Path) -> None:
    trained = ORTLightningModule(mlp_adamw.artifacts, lr=0.05)
    _trainer(tmp_path, max_steps=4).fit(trained, _loader())
    fresh = ORTLightningModule(mlp_adamw.artifacts)
    fresh.load_state_dict(trained.state_dict())
    x, _ = blobs(16, seed=5)
    torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)
    assert all(isinstance(t, torch.Tensor) for t in trained.state_dict().values())


# ----------------------------------------------------------------------------- ORTCheckpoint files
def test_files_are_ort_checkpoints_with_properties(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    callback = ORTCheckpoint(tmp_path, save_top_k=-1)
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(module, _loader())
    names = sorted(p.name for p in tmp_path.glob("*.ortckpt"))
    assert names == ["epoch=0-step=8.ortckpt", "epoch=1-step=16.ortckpt", "last.ortckpt"]
    state = CheckpointState.load_checkpoint(tmp_path / "epoch=0-step=8.ortckpt")
    properties = {name: state.properties[name] for name in ("epoch", "global_step", "lr", "ort_lightning_version")}
    expected_lr = 0.05 * (16 - 8) / (16 - 4)  # the lr of the next step, from the closed-form schedule
    assert properties["epoch"] == 0
    assert properties["global_step"] == 8
    assert properties["lr"] == pytest.approx(expected_lr, rel=1e-6)
    assert properties["ort_lightning_version"] == ort_lightning.__version__
    assert all(verify_digest(path) for path in tmp_path.glob("*.ortckpt"))


def test_every_n_train_steps_and_recent_top_k(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    callback = ORTCheckpoint(tmp_path, every_n_train_steps=3, save_top_k=2, save_last=False, monitor="step", mode="max")
    _trainer(tmp_path, max_epochs=2, callbacks=[callback]).fit(module, _loader())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch=1-step=12.ortckpt", "epoch=1-step=12.ortckpt.sha256",
        "epoch=1-step=15.ortckpt", "epoch=1-step=15.ortckpt.sha256",
    ]
    assert callback.best_path == tmp_path / "epoch=1-step=15.ortckpt"


class _RecordMetric(Callback):
    def __init__(self, name: str) -> None:
        self.name, self.values = name, []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.values.append(trainer.callback_metrics[self.name].item())


@pytest.mark.parametrize("mode", ["min", "max"], ids=str)
def test_monitor_keeps_the_best_k(mlp_sgd: Exported, tmp_path: Path, mode: str) -> None:
    module = ORTLightningModule(mlp_sgd.artifacts, lr=0.5)
    recorder = _RecordMetric("val_loss")
    callback = ORTCheckpoint(tmp_path, monitor="val_loss", mode=mode, save_top_k=2, filename="{epoch}-{val_loss:.4f}")
    trainer = _trainer(tmp_path, max_epochs=4, callbacks=[recorder, callback])
    trainer.fit(module, _loader(), _val_loader())
    ranked = sorted(range(4), key=lambda e: recorder.values[e], reverse=mode == "max")[:2]
    expected = {f"epoch={e}-val_loss={recorder.values[e]:.4f}.ortckpt" for e in ranked}
    assert {p.name for p in tmp_path.glob("epoch=*.ortckpt")} == expected
    assert len(list(tmp_path.glob("*.sha256"))) == 3  # two kept files and last
    best = CheckpointState.load_checkpoint(callback.best_path)
    assert best.properties["monitor"] == "val_loss"
    assert best.properties["monitor_value"] == pytest.approx(recorder.values[ranked[0]])


def test_missing_monitor_is_a_clear_error(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    callback = ORTCheckpoint(tmp_path, monitor="val_acc")
    with pytest.raises(CheckpointError, match=r"monitor='val_acc'.*no such logged metric.*log it"):
        _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(module, _loader())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(mode="best"), r"`mode` to be 'min' or 'max'"),
        (dict(save_top_k=-2), r"`save_top_k` to be an int >= -1"),
        (dict(every_n_train_steps=-1), r"`every_n_train_steps` to be an int >= 0"),
        (dict(save_top_k=2), r"save_top_k=2, monitor=None\) has nothing to rank files by; pass a `monitor`"),
        (dict(every_n_train_steps=2, every_n_epochs=1), r"mutually exclusive; pass only one of every_n_train_steps"),
        (dict(save_last="link"), r"`save_last` to be True or False, but got 'link'; ORTCheckpoint writes last.ortckpt"),
    ],
    ids=["mode", "top_k", "steps", "top_k_without_monitor", "exclusive_triggers", "save_last_link"],
)
def test_bad_options_are_refused(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ORTCheckpoint(tmp_path, **options)


def test_filename_formats_as_model_checkpoint_does(tmp_path: Path) -> None:
    metrics = {"val_loss": 0.5, "val_loss_ema": 0.25, "epoch": 2, "step": 7}
    for template in ("{val_loss}-{val_loss_ema}", "{epoch}-{val_loss:.1f}", "{epoch:03d}", "{missing:d}"):
        lightning = ModelCheckpoint(dirpath=tmp_path, filename=template)
        expected = Path(lightning.format_checkpoint_name({k: torch.tensor(v) for k, v in metrics.items()})).stem
        assert ORTCheckpoint(tmp_path, filename=template).format_name(metrics) == expected, template
    assert ORTCheckpoint(tmp_path, filename="{val_loss}-{val_loss_ema}").format_name(metrics) == (
        "val_loss=0.5-val_loss_ema=0.25"
    )


# ----------------------------------------------------------------------------- damaged and foreign files
def _damage(kind: str, path: Path) -> None:
    data = path.read_bytes()
    if kind == "flipped":  # a byte inside the tensor data: ORT itself loads this without complaint
        index = len(data) - 64
        path.write_bytes(data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:])
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")


@pytest.fixture
def saved(mlp_adamw: Exported, tmp_path: Path) -> Path:
    return ORTLightningModule(mlp_adamw.artifacts).save_ort_checkpoint(tmp_path / "state.ortckpt")


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("flipped", r"corrupted or truncated: its sha256 .* matches none of .*resume from another checkpoint"),
        ("truncated", r"corrupted or truncated: its sha256 .* matches none of"),
        ("empty", r"is empty \(0 bytes\).*resume from another checkpoint"),
    ],
    ids=str,
)
def test_damaged_checkpoint_is_refused(mlp_adamw: Exported, saved: Path, kind: str, message: str) -> None:
    _damage(kind, saved)
    with pytest.raises(CheckpointError, match=message):
        ORTLightningModule(mlp_adamw.artifacts, checkpoint=saved)


@pytest.mark.parametrize("kind", ["truncated", "empty"], ids=str)
def test_damaged_checkpoint_without_sidecar_is_refused(mlp_adamw: Exported, saved: Path, kind: str) -> None:
    digest_path(saved).unlink()
    _damage(kind, saved)
    with pytest.raises(CheckpointError, match=r"ONNX Runtime cannot read checkpoint|is empty \(0 bytes\)"):
        ORTLightningModule(mlp_adamw.artifacts, checkpoint=saved)


def test_missing_checkpoint_is_refused(mlp_adamw: Exported, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"does not exist or is not a file; pass the path"):
        ORTLightningModule(mlp_adamw.artifacts, checkpoint=tmp_path / "nowhere.ortckpt")


def test_checkpoint_of_other_artifacts_is_refused(mlp_adamw: Exported, bn_dropout_cnn: Exported) -> None:
    foreign = bn_dropout_cnn.artifacts.checkpoint
    with pytest.raises(CheckpointError, match=r"does not match the artifacts.*missing \['fc1.bias'.*unexpected"):
        ORTLightningModule(mlp_adamw.artifacts, checkpoint=foreign)


def test_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "file.bin"
    atomic_write(target, lambda temp: temp.write_bytes(b"first"))

    def crash(temp: Path) -> None:
        temp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, crash)
    assert target.read_bytes() == b"first"
    assert verify_digest(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin", "file.bin.sha256"]


# ----------------------------------------------------------------------------- inference export
@pytest.mark.parametrize("fixture", ["mlp_adamw", "bn_dropout_cnn"], ids=str)
def test_inference_model_matches_eval_graph(request: pytest.FixtureRequest, fixture: str, tmp_path: Path) -> None:
    exported: Exported = request.getfixturevalue(fixture)
    module = ORTLightningModule(exported.artifacts)
    path = module.export_inference_model(tmp_path / "model.onnx")
    options = onnxruntime.SessionOptions()
    # NOTE: with graph optimizations on, ORT may fuse MatMul+Add or Conv+BatchNorm, which
    # reorders float sums; off, both sessions run the same kernels on the same graph.
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [s.name for s in exported.artifacts.manifest.inputs]
    shape = (16, 4) if fixture == "mlp_adamw" else (16, 1, 8, 8)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6))
    (ort_out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(ort_out, module(x).numpy(), rtol=0, atol=1e-6)


def test_inference_model_written_at_fit_end(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.05)
    callback = ORTCheckpoint(tmp_path, inference_model=tmp_path / "final.onnx")
    _trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(module, _loader())
    session = onnxruntime.InferenceSession(tmp_path / "final.onnx", providers=["CPUExecutionProvider"])
    x, _ = blobs(8, seed=7)
    np.testing.assert_allclose(session.run(None, {"input": x.numpy()})[0], module(x).numpy(), rtol=0, atol=1e-6)


def test_unknown_inference_output_is_refused(mlp_adamw: Exported, tmp_path: Path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    with pytest.raises(ConfigurationError, match=r"outputs of the eval graph .*'logits'.*but got \['probs'\]"):
        module.export_inference_model(tmp_path / "model.onnx", outputs=["probs"])


# ----------------------------------------------------------------------------- console script
def test_inspect_shows_progress_and_refuses_damage(mlp_adamw: Exported, tmp_path: Path, capsys) -> None:
    from ort_lightning.cli import main

    module = ORTLightningModule(mlp_adamw.artifacts, **SCHEDULE)
    _trainer(tmp_path, max_epochs=1, callbacks=[ORTCheckpoint(tmp_path)]).fit(module, _loader())
    assert main(["inspect", str(tmp_path / "last.ortckpt")]) == 0
    shown = capsys.readouterr().out
    version = ort_lightning.__version__
    patterns = (r"epoch: +0 \(0-based", r"global_step: +8\n", rf"ort_lightning_version: {version}", r"lr: +0\.0333")
    for pattern in patterns:
        assert re.search(pattern, shown), shown
    _damage("truncated", tmp_path / "last.ortckpt")
    assert main(["inspect", str(tmp_path / "last.ortckpt")]) == 2
    assert "CheckpointError: Checkpoint" in capsys.readouterr().err


def test_a_pickled_module_keeps_where_its_run_starts(mlp_adamw: Exported, tmp_path: Path) -> None:
    """A pickle (Lightning's spawn launcher, a deep copy) keeps the run's origin: its steps, epochs and seed."""
    path = ORTLightningModule(mlp_adamw.artifacts).save_ort_checkpoint(
        tmp_path / "state.ortckpt", properties={"global_step": 7, "next_epoch": 2, "seed": 1234})
    resumed = ORTLightningModule(mlp_adamw.artifacts, checkpoint=path)
    twin = pickle.loads(pickle.dumps(resumed))
    assert (twin.start_progress, twin.seed) == ({"global_step": 7, "epoch": 2}, 1234)
    for (name, weight), (_, copied) in zip(resumed.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(weight, copied), name
        assert weight.data_ptr() != copied.data_ptr(), name
