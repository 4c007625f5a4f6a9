"""Damaged or mismatched artifacts folders and ``.ckpt`` files: each gives one package error, never a raw one.

Every case is loaded in a child process of its own (tests/artifacts/damage_worker.py forks one per case), so
that a crash inside ONNX Runtime cannot end the test run: 0 raw errors (the exception must be one
of ``ort_lightning.errors``), 0 folders or files accepted silently, 0 signals. The folders are
exported once per session and copied per case.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import MLP, Exported
from tests.helpers import ROOT, quiet_trainer

WORKER = Path(__file__).with_name("damage_worker.py")
Damage = Callable[[Path, "Sources"], None]


@dataclass(frozen=True)
class Sources:
    """The pristine folders and files a damage copies from."""

    mlp: Path  # export_artifacts(MLP 4-8-3), AdamW, .onnx graphs
    mlp_sgd: Path  # the same model exported with SGD
    wider: Path  # MLP 4-16-3: the same parameter names, other shapes
    cnn: Path  # another model with other inputs
    both: Path  # MLP exported with ort_format=True: .onnx and .ort graphs
    ort_only: Path  # a copy of `both` without its .onnx graphs (what a device gets)
    generated: Path  # generate_artifacts of MLP 4-8-3 (no manifest)
    generated_wider: Path  # generate_artifacts of MLP 4-16-3
    ckpt: Path  # a Lightning .ckpt of a fit on `mlp`
    wider_ckpt: Path  # a Lightning .ckpt of a fit on `wider`


# ----------------------------------------------------------------------------- damages
def _truncate(name: str, keep: float = 0.5) -> Damage:
    def damage(folder: Path, _: Sources) -> None:
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * keep)])
    return damage


def _garbage(name: str) -> Damage:
    def damage(folder: Path, _: Sources) -> None:
        path = folder / name
        path.write_bytes(random.Random(name).randbytes(max(path.stat().st_size, 64)))
    return damage


def _copy_from(source: str, name: str, target: str | None = None) -> Damage:
    """Put `source`'s file `name` (a role of `Sources`) at `target` (default: the same name)."""
    def damage(folder: Path, sources: Sources) -> None:
        shutil.copy(getattr(sources, source) / name, folder / (target or name))
    return damage


def _move(name: str, target: str) -> Damage:
    def damage(folder: Path, _: Sources) -> None:
        shutil.copy(folder / name, folder / target)
    return damage


def _flip_weight_bits(folder: Path, _: Sources) -> None:
    """Flip one bit inside fc1.weight's bytes in the checkpoint: the file still parses."""
    path = folder / "checkpoint"
    data = bytearray(path.read_bytes())
    weight = _checkpoint_weight(path)
    start = bytes(data).find(weight)
    assert start >= 0, "fc1.weight's bytes are not in the checkpoint"
    data[start + 5] ^= 0x10
    path.write_bytes(bytes(data))


def _checkpoint_weight(path: Path) -> bytes:
    from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint(str(path))
    return bytes(state.parameters["fc1.weight"].data.tobytes())


def _manifest(edit: Callable[[dict[str, Any]], None]) -> Damage:
    def damage(folder: Path, _: Sources) -> None:
        path = folder / "ort_lightning.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        edit(data)
        path.write_text(json.dumps(data), encoding="utf-8")
    return damage


def _manifest_bytes(data: bytes) -> Damage:
    def damage(folder: Path, _: Sources) -> None:
        (folder / "ort_lightning.json").write_bytes(data)
    return damage


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        data[key] = value
    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        del data[key]
    return edit


def _ckpt(edit: Callable[[dict[str, Any]], Any], source: str = "ckpt") -> Damage:
    """Write ``run.ckpt`` into the case folder: `source`'s .ckpt loaded, edited, saved again."""
    def damage(folder: Path, sources: Sources) -> None:
        checkpoint = torch.load(getattr(sources, source), map_location="cpu", weights_only=True)
        result = edit(checkpoint)
        torch.save(checkpoint if result is None else result, folder / "run.ckpt")
    return damage


def _ckpt_bytes(edit: Callable[[bytes], bytes]) -> Damage:
    def damage(folder: Path, sources: Sources) -> None:
        (folder / "run.ckpt").write_bytes(edit(sources.ckpt.read_bytes()))
    return damage


def _ort_state(edit: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    def change(checkpoint: dict[str, Any]) -> None:
        checkpoint["ort_state"] = edit(checkpoint["ort_state"])
    return change


def _flip_state(state: torch.Tensor) -> torch.Tensor:
    flipped = state.clone()
    flipped[len(flipped) - 40] ^= 0x10  # inside the last tensor's bytes
    return flipped


def _identity(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(checkpoint: dict[str, Any]) -> None:
        checkpoint["ort_lightning_artifacts"][key] = value
    return change


def _progress(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(checkpoint: dict[str, Any]) -> None:
        checkpoint["ort_lightning_progress"][key] = value
    return change


def _pop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(checkpoint: dict[str, Any]) -> None:
        del checkpoint[key]
    return change


def _older(damage: Damage) -> Damage:
    """`damage` to a folder whose manifest predates the checkpoint digest (nothing vouches for its checkpoint)."""
    def both(folder: Path, sources: Sources) -> None:
        _manifest(_drop("checkpoint_sha256"))(folder, sources)
        damage(folder, sources)
    return both


@dataclass(frozen=True)
class Case:
    """One damage: the folder it starts from, what is done to it, how it is loaded, the error expected."""

    id: str
    base: str
    damage: Damage
    error: str  # the package error's class; MESSAGES[id] is what its message must say
    action: str = "folder"


#: What each case's error must say (a regex searched in the message).
MESSAGES = {
    "older-checkpoint-of-wider-model": (
        r"The checkpoint .*checkpoint holds fc1\.weight of shape \[16, 4\], but training_model\.onnx takes "
        r"fc1\.weight of shape \[8, 4\]: the checkpoint belongs to another model"
    ),
    "older-checkpoint-truncated": r"ONNX Runtime cannot load the checkpoint .*checkpoint .*damaged, truncated",
    "older-checkpoint-garbage": r"ONNX Runtime cannot load the checkpoint .*checkpoint .*not an ORT checkpoint",
    'training-truncated': r'training_model\.onnx is not a readable ONNX model .*damaged or truncated',
    'training-garbage': r'training_model\.onnx is not a readable ONNX model',
    'training-empty': r'training_model\.onnx holds no graph \(0 bytes, no nodes\): it is empty or truncated',
    'eval-truncated': r'eval_model\.onnx is not a readable ONNX model',
    'optimizer-garbage': r'optimizer_model\.onnx is not a readable ONNX model',
    'eval-in-training-slot': (
        r'training_model\.onnx holds no gradients and no optimizer node \(an eval or inference graph\), '
        r'not the training graph'
    ),
    'training-in-eval-slot': r'eval_model\.onnx holds a training graph .*, not the eval graph its name says',
    'optimizer-in-training-slot': (
        r'training_model\.onnx holds an optimizer update \(AdamWOptimizer\), not the training graph'
    ),
    'sgd-graph-under-adamw-manifest': (
        r"says optimizer='adamw', but optimizer_model\.onnx runs 'sgd' \(SGDOptimizerV2\)"
    ),
    'training-graph-of-another-model': (
        r"eval_model\.onnx takes input of shape \['batch', 4\], but training_model\.onnx takes "
        r"\['batch', 1, 8, 8\]: the two graphs are of different models"
    ),
    'training-graph-of-wider-model': (
        r'eval_model\.onnx takes fc1\.weight of shape \[8, 4\], but training_model\.onnx takes \[16, '
        r'4\]'
    ),
    'ort-training-truncated': (
        r'ONNX Runtime cannot load the graphs .*training_model\.ort and .*eval_model\.ort .*damaged or '
        r'truncated'
    ),
    'ort-optimizer-garbage': r'ONNX Runtime cannot load the optimizer graph .*optimizer_model\.ort .*damaged',
    'ort-eval-in-training-slot': (
        r'ONNX Runtime cannot load the graphs .*training_model\.ort .*Gradient buffer input not provided'
    ),
    'ort-operators-not-utf8': (
        r'optimizer_model\.required_operators\.config is not UTF-8 text .*copy it again .* or delete it'
    ),
    'checkpoint-truncated': (
        r'checkpoint has sha256 \w+\.\.\., but .*ort_lightning\.json records \w+\.\.\. .*damaged '
        r'\(flipped or lost bytes\)'
    ),
    'checkpoint-garbage': r'checkpoint has sha256 .* records',
    'checkpoint-empty': r'checkpoint has sha256 e3b0c44298fc1c14\.\.\.',
    'checkpoint-bit-flip': r'checkpoint has sha256 .* records .*damaged \(flipped or lost bytes\)',
    'checkpoint-of-another-model': r"checkpoint has sha256 .* replaced by another export's",
    'checkpoint-of-wider-model': r"checkpoint has sha256 .* replaced by another export's",
    'checkpoint-of-another-export': r"checkpoint has sha256 .* replaced by another export's",
    'manifest-not-json': r'ort_lightning\.json is not valid JSON',
    'manifest-not-utf8': r'ort_lightning\.json is not UTF-8 text \(invalid continuation byte at byte 24\)',
    # NOTE: json's own detail depends on where the cut falls; the package's part of the message is pinned.
    'manifest-truncated': r'ort_lightning\.json is not valid JSON \(.*\); re-export the artifacts',
    'manifest-a-list': r'is not an ort-lightning manifest',
    'manifest-trainable-5': r'has trainable=5, but expected a list of names; the manifest is damaged or was edited',
    'manifest-loss-hinge': r'has loss=\"hinge\", but expected one of \[\'cross_entropy\'',
    'manifest-says-sgd': r"says optimizer='sgd', but optimizer_model\.onnx runs 'adamw' \(AdamWOptimizer\)",
    'manifest-optimizer-5': r"has optimizer=5, but expected one of \['adamw', 'sgd', 'none'\]",
    'manifest-inputs-a-string': r'has inputs=\"input\", but expected a list of \{name, dtype',
    'manifest-shape-a-string': r'has inputs=.*\"shape\": \"batch\".*, but expected a list of',
    'manifest-unknown-dtype': (
        r'has inputs=.*\"float99\".*, but expected a list of \{name, dtype \(one of \[\'float32\''
    ),
    'manifest-without-loss-output': r"lacks or mangles the field 'loss_output' \(it is missing\)",
    'manifest-trainable-subset': (
        r"lists the trainable parameters \['fc1\.bias', 'fc1\.weight'\], but training_model\.onnx "
        r"computes gradients for \['fc1\.bias', 'fc1\.weight', 'fc2\.bias', 'fc2\.weight'\]"
    ),
    'manifest-frozen-unknown': (
        r"lists the frozen parameters or buffers \['fc3\.weight'\], which training_model\.onnx does not "
        r"take"
    ),
    'manifest-loss-output-unknown': (
        r"says the loss is 'logits' .* but training_model\.onnx outputs \['loss/cross_entropy/out', "
        r"'logits'\] \(the loss first\)"
    ),
    'manifest-loss-mse-with-int-labels': (
        r"says loss='mse', which takes floating-point targets, but the graphs take the label 'labels' as int64"
    ),
    'manifest-digest-5': r'has checkpoint_sha256=5, but expected 64 lowercase hex digits',
    'manifest-of-another-model': (
        r"describes the inputs \[input: float32\['batch', 1, 8, 8\].* the manifest belongs to another model"
    ),
    'manifest-of-wider-model': r"checkpoint has sha256 .* or the manifest is another export's",
    'manifest-of-sgd-export': r"says optimizer='sgd', but optimizer_model\.onnx runs 'adamw'",
    'generated-checkpoint-of-wider-model': (
        r'holds fc1\.bias of shape \[16\], but the training graph takes fc1\.bias of shape \[8\]: the '
        r'checkpoint belongs to another model'
    ),
    'generated-training-truncated': r'training_model\.onnx is not a readable ONNX model',
    'generated-checkpoint-truncated': r'ONNX Runtime cannot read the checkpoint .*checkpoint',
    'generated-eval-of-wider-model': (
        r'eval_model\.onnx takes fc1\.weight of shape \[16, 4\], but training_model\.onnx takes \[8, '
        r'4\]'
    ),
    'ckpt-truncated': (
        r'run\.ckpt is not a checkpoint torch\.save wrote \(\d+ bytes, no zip archive\): it is truncated'
    ),
    'ckpt-garbage': r'run\.ckpt is not a checkpoint torch\.save wrote',
    'ckpt-empty': r'run\.ckpt is not a checkpoint torch\.save wrote \(0 bytes',
    'ckpt-of-wider-model': r"does not match the artifacts in .*different \['fc1\.bias: \[16\] vs \[8\]'",
    'ckpt-without-ort-state': r"holds no ORT state \(no 'ort_state' entry among \[",
    'ckpt-ort-state-a-list': (
        r"Expected checkpoint\['ort_state'\] to be a uint8 tensor of ORT checkpoint bytes, but got list"
    ),
    'ckpt-ort-state-truncated': (
        r"The ORT state in checkpoint\['ort_state'\] \(\d+ bytes\) does not match the sha256 stored with "
        r"it"
    ),
    'ckpt-ort-state-bit-flip': r'does not match the sha256 stored with it .*damaged \(flipped or lost bytes\)',
    'ckpt-identity-parameters-5': r"holds a damaged record of its artifacts under 'ort_lightning_artifacts'",
    'ckpt-identity-a-string': r'holds a damaged record of its artifacts .* got mlp\)',
    'ckpt-progress-step-a-string': (
        r"Expected checkpoint\['ort_lightning_progress'\] to be a dict of integers .*'global_step': 'two'"
    ),
    'ckpt-not-a-dict': r'run\.ckpt holds a list, but a Lightning checkpoint is a dict',
}
CASES = [
    # graphs
    Case("training-truncated", "mlp", _truncate("training_model.onnx"), "ArtifactError"),
    Case("training-garbage", "mlp", _garbage("training_model.onnx"), "ArtifactError"),
    Case("training-empty", "mlp", _truncate("training_model.onnx", 0.0), "ArtifactError"),
    Case("eval-truncated", "mlp", _truncate("eval_model.onnx", 0.7), "ArtifactError"),
    Case("optimizer-garbage", "mlp", _garbage("optimizer_model.onnx"), "ArtifactError"),
    Case("eval-in-training-slot", "mlp", _move("eval_model.onnx", "training_model.onnx"), "ArtifactError"),
    Case("training-in-eval-slot", "mlp", _move("training_model.onnx", "eval_model.onnx"), "ArtifactError"),
    Case("optimizer-in-training-slot", "mlp", _move("optimizer_model.onnx", "training_model.onnx"), "ArtifactError"),
    Case("sgd-graph-under-adamw-manifest", "mlp", _copy_from("mlp_sgd", "optimizer_model.onnx"), "ArtifactError"),
    Case("training-graph-of-another-model", "mlp", _copy_from("cnn", "training_model.onnx"), "ArtifactError"),
    Case("training-graph-of-wider-model", "mlp", _copy_from("wider", "training_model.onnx"), "ArtifactError"),
    Case("ort-training-truncated", "ort_only", _truncate("training_model.ort"), "ArtifactError"),
    Case("ort-optimizer-garbage", "ort_only", _garbage("optimizer_model.ort"), "ArtifactError"),
    Case("ort-eval-in-training-slot", "ort_only", _move("eval_model.ort", "training_model.ort"), "ArtifactError"),
    Case("ort-operators-not-utf8", "ort_only", _garbage("optimizer_model.required_operators.config"),
         "ArtifactError"),
    # the checkpoint
    Case("checkpoint-truncated", "mlp", _truncate("checkpoint"), "ArtifactError"),
    Case("checkpoint-garbage", "mlp", _garbage("checkpoint"), "ArtifactError"),
    Case("checkpoint-empty", "mlp", _truncate("checkpoint", 0.0), "ArtifactError"),
    Case("checkpoint-bit-flip", "mlp", _flip_weight_bits, "ArtifactError"),
    Case("checkpoint-of-another-model", "mlp", _copy_from("cnn", "checkpoint"), "ArtifactError"),
    Case("checkpoint-of-wider-model", "mlp", _copy_from("wider", "checkpoint"), "ArtifactError"),
    Case("checkpoint-of-another-export", "mlp", _copy_from("mlp_sgd", "checkpoint"), "ArtifactError"),
    Case("older-checkpoint-of-wider-model", "mlp", _older(_copy_from("wider", "checkpoint")), "ArtifactError"),
    Case("older-checkpoint-truncated", "mlp", _older(_truncate("checkpoint")), "ArtifactError"),
    Case("older-checkpoint-garbage", "mlp", _older(_garbage("checkpoint")), "ArtifactError"),
    # the manifest
    Case("manifest-not-json", "mlp", _manifest_bytes(b"{'format': nope"), "ArtifactError"),
    Case("manifest-not-utf8", "mlp", _manifest_bytes('{"loss": "entropie croisée"}'.encode("latin-1")),
         "ArtifactError"),
    Case("manifest-truncated", "mlp", _truncate("ort_lightning.json", 0.6), "ArtifactError"),
    Case("manifest-a-list", "mlp", _manifest_bytes(b"[1, 2]"), "ArtifactError"),
    Case("manifest-trainable-5", "mlp", _manifest(_set("trainable", 5)), "ArtifactError"),
    Case("manifest-loss-hinge", "mlp", _manifest(_set("loss", "hinge")), "ArtifactError"),
    Case("manifest-says-sgd", "mlp", _manifest(_set("optimizer", "sgd")), "ArtifactError"),
    Case("manifest-optimizer-5", "mlp", _manifest(_set("optimizer", 5)), "ArtifactError"),
    Case("manifest-inputs-a-string", "mlp", _manifest(_set("inputs", "input")), "ArtifactError"),
    Case("manifest-shape-a-string", "mlp",
         _manifest(lambda m: m["inputs"][0].__setitem__("shape", "batch")), "ArtifactError"),
    Case("manifest-unknown-dtype", "mlp",
         _manifest(lambda m: m["inputs"][0].__setitem__("dtype", "float99")), "ArtifactError"),
    Case("manifest-without-loss-output", "mlp", _manifest(_drop("loss_output")), "ArtifactError"),
    Case("manifest-trainable-subset", "mlp", _manifest(_set("trainable", ["fc1.weight", "fc1.bias"])),
         "ArtifactError"),
    Case("manifest-frozen-unknown", "mlp", _manifest(_set("frozen", ["fc3.weight"])), "ArtifactError"),
    Case("manifest-loss-output-unknown", "mlp", _manifest(_set("loss_output", "logits")), "ArtifactError"),
    Case("manifest-loss-mse-with-int-labels", "mlp", _manifest(_set("loss", "mse")), "ArtifactError"),
    Case("manifest-digest-5", "mlp", _manifest(_set("checkpoint_sha256", 5)), "ArtifactError"),
    Case("manifest-of-another-model", "mlp", _copy_from("cnn", "ort_lightning.json"), "ArtifactError"),
    Case("manifest-of-wider-model", "mlp", _copy_from("wider", "ort_lightning.json"), "ArtifactError"),
    Case("manifest-of-sgd-export", "mlp", _copy_from("mlp_sgd", "ort_lightning.json"), "ArtifactError"),
    # generate_artifacts folders (no manifest)
    Case("generated-checkpoint-of-wider-model", "generated", _copy_from("generated_wider", "checkpoint"),
         "ArtifactError"),
    Case("generated-training-truncated", "generated", _truncate("training_model.onnx"), "ArtifactError"),
    Case("generated-checkpoint-truncated", "generated", _truncate("checkpoint"), "ArtifactError"),
    Case("generated-eval-of-wider-model", "generated", _copy_from("generated_wider", "eval_model.onnx"),
         "ArtifactError"),
    # Lightning .ckpt files, loaded with load_from_checkpoint(ckpt, artifacts=folder)
    Case("ckpt-truncated", "mlp", _ckpt_bytes(lambda data: data[: len(data) // 2]), "CheckpointError",
         "ckpt"),
    Case("ckpt-garbage", "mlp", _ckpt_bytes(lambda data: random.Random(0).randbytes(len(data))), "CheckpointError",
         "ckpt"),
    Case("ckpt-empty", "mlp", _ckpt_bytes(lambda _: b""), "CheckpointError", "ckpt"),
    Case("ckpt-of-wider-model", "mlp", _ckpt(lambda _: None, source="wider_ckpt"), "CheckpointError", "ckpt"),
    Case("ckpt-without-ort-state", "mlp", _ckpt(_pop("ort_state")), "CheckpointError", "ckpt"),
    Case("ckpt-ort-state-a-list", "mlp", _ckpt(_ort_state(lambda s: s.tolist()[:8])), "CheckpointError",
         "ckpt"),
    Case("ckpt-ort-state-truncated", "mlp", _ckpt(_ort_state(lambda s: s[: len(s) // 2].clone())),
         "CheckpointError", "ckpt"),
    Case("ckpt-ort-state-bit-flip", "mlp", _ckpt(_ort_state(_flip_state)), "CheckpointError", "ckpt"),
    Case("ckpt-identity-parameters-5", "mlp", _ckpt(_identity("parameters", 5)), "CheckpointError", "ckpt"),
    Case("ckpt-identity-a-string", "mlp", _ckpt(lambda c: c.__setitem__("ort_lightning_artifacts", "mlp")),
         "CheckpointError", "ckpt"),
    Case("ckpt-progress-step-a-string", "mlp", _ckpt(_progress("global_step", "two")), "CheckpointError",
         "ckpt"),
    Case("ckpt-not-a-dict", "mlp", _ckpt(lambda _: [1, 2, 3]), "CheckpointError", "ckpt"),
]


# ----------------------------------------------------------------------------- the pristine folders
def _generated(model: torch.nn.Module, folder: Path) -> Path:
    """What ONNX Runtime's own ``generate_artifacts`` writes for `model` (ORT's tutorial export)."""
    import io

    import onnx
    from onnxruntime.training import artifacts as ort_artifacts

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # NOTE: ORT's tutorials use the TorchScript exporter, which torch now calls legacy at every export.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model, (torch.randn(2, 4),), buffer, input_names=["input"], output_names=["logits"], opset_version=17,
            do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False,
        )
    folder.mkdir()
    ort_artifacts.generate_artifacts(
        onnx.load_from_string(buffer.getvalue()), artifact_directory=str(folder),
        requires_grad=[name for name, _ in model.named_parameters()], optimizer=ort_artifacts.OptimType.AdamW,
        loss=ort_artifacts.LossType.CrossEntropyLoss,
    )
    return folder


def _fitted_ckpt(folder: Path, path: Path) -> Path:
    from torch.utils.data import DataLoader, TensorDataset

    from ort_lightning import ORTLightningModule

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    trainer = quiet_trainer(max_steps=2, default_root_dir=path.parent)
    trainer.fit(ORTLightningModule(folder), DataLoader(data, batch_size=8))
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def sources(mlp_adamw: Exported, mlp_sgd: Exported, bn_dropout_cnn: Exported,
            tmp_path_factory: pytest.TempPathFactory) -> Sources:
    from ort_lightning import export_artifacts

    root = tmp_path_factory.mktemp("pristine")
    torch.manual_seed(3)
    wider = export_artifacts(MLP(hidden=16), torch.zeros(2, 4), root / "wider", verify=False).directory
    torch.manual_seed(4)
    both = export_artifacts(MLP(), torch.zeros(2, 4), root / "both", verify=False, ort_format=True).directory
    ort_only = Path(shutil.copytree(both, root / "ort_only"))
    for graph in ort_only.glob("*.onnx"):
        graph.unlink()
    torch.manual_seed(5)
    generated = _generated(MLP(), root / "generated")
    generated_wider = _generated(MLP(hidden=16), root / "generated_wider")
    mlp = mlp_adamw.artifacts.directory
    return Sources(
        mlp=mlp, mlp_sgd=mlp_sgd.artifacts.directory, wider=wider, cnn=bn_dropout_cnn.artifacts.directory,
        both=both, ort_only=ort_only, generated=generated, generated_wider=generated_wider,
        ckpt=_fitted_ckpt(mlp, root / "mlp.ckpt"), wider_ckpt=_fitted_ckpt(wider, root / "wider.ckpt"),
    )


@pytest.fixture(scope="module")
def outcomes(sources: Sources, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Every case damaged in a copy of its folder, then loaded by the worker, one child process per case."""
    root = tmp_path_factory.mktemp("damaged")
    listed = []
    for case in CASES:
        folder = Path(shutil.copytree(getattr(sources, case.base), root / case.id))
        case.damage(folder, sources)
        listed.append({"id": case.id, "action": case.action, "folder": str(folder), "ckpt": str(folder / "run.ckpt")})
    cases = root / "cases.json"
    cases.write_text(json.dumps(listed))
    # NOTE: the worker imports the package from this checkout, as the tests do, not from wherever it is installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(WORKER), str(cases)], capture_output=True, text=True, timeout=240,
                            check=False, env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # every case loads in a worker process
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_damaged_file_gives_one_package_error(case: Case, outcomes: dict[str, dict[str, str]]) -> None:
    outcome = outcomes[case.id]
    assert outcome["outcome"] == "error", f"{case.id}: {outcome}"
    assert outcome["module"] == "ort_lightning.errors", f"{case.id}: a raw error {outcome}"
    assert outcome["class"] == case.error, f"{case.id}: {outcome}"
    assert re.search(MESSAGES[case.id], outcome["message"]), f"{case.id}: {outcome['message']}"


# ----------------------------------------------------------------------------- what must still load
def _reloaded(ckpt: Path, folder: Path) -> dict[str, torch.Tensor]:
    from ort_lightning import ORTLightningModule

    module = ORTLightningModule.load_from_checkpoint(ckpt, artifacts=folder)
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def test_export_records_the_checkpoints_sha256(sources: Sources) -> None:
    manifest = json.loads((sources.mlp / "ort_lightning.json").read_text(encoding="utf-8"))
    assert manifest["checkpoint_sha256"] == hashlib.sha256((sources.mlp / "checkpoint").read_bytes()).hexdigest()


def test_a_ckpt_of_the_onnx_graphs_loads_on_the_same_exports_ort_folder(sources: Sources, tmp_path: Path) -> None:
    ckpt = _fitted_ckpt(sources.both, tmp_path / "both.ckpt")
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    restored = _reloaded(ckpt, sources.ort_only)
    assert set(restored) == set(stored)
    assert all(torch.equal(restored[name], stored[name]) for name in stored)


def test_files_written_before_their_digests_still_load(sources: Sources, tmp_path: Path) -> None:
    from ort_lightning import ORTLightningModule, TrainingArtifacts

    folder = Path(shutil.copytree(sources.mlp, tmp_path / "older"))
    _manifest(_drop("checkpoint_sha256"))(folder, sources)
    assert TrainingArtifacts.load(folder).manifest.checkpoint_sha256 is None
    ORTLightningModule(folder)
    checkpoint = torch.load(sources.ckpt, map_location="cpu", weights_only=True)
    del checkpoint["ort_lightning_progress"]["ort_state_sha256"]
    torch.save(checkpoint, tmp_path / "older.ckpt")
    restored = _reloaded(tmp_path / "older.ckpt", sources.mlp)
    assert all(torch.equal(restored[name], tensor) for name, tensor in checkpoint["state_dict"].items())
