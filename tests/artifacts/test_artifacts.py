"""TrainingArtifacts.load and the ort_lightning.json manifest."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx
import onnxruntime
import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module, Optimizer

import ort_lightning
from ort_lightning import TrainingArtifacts
from ort_lightning.artifacts import MANIFEST_NAME, Manifest, TensorSpec
from ort_lightning.errors import ArtifactError
from tests.conftest import Exported


@pytest.fixture
def folder(mlp_adamw: Exported, tmp_path: Path) -> Path:
    """A private copy of exported artifacts, free to damage."""
    return Path(shutil.copytree(mlp_adamw.artifacts.directory, tmp_path / "artifacts"))


def test_load_round_trips_the_manifest(mlp_adamw: Exported, folder: Path) -> None:
    loaded = TrainingArtifacts.load(str(folder))
    assert loaded.manifest == mlp_adamw.artifacts.manifest
    assert loaded.directory == folder
    assert [
        loaded.training_model.name,
        loaded.eval_model.name,
        loaded.optimizer_model.name,
        loaded.checkpoint.name,
    ] == ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"]
    # The paths are what ORT itself needs to assemble a trainer.
    state = CheckpointState.load_checkpoint(str(loaded.checkpoint))
    module = Module(str(loaded.training_model), state, str(loaded.eval_model))
    Optimizer(str(loaded.optimizer_model), module)
    assert module.input_names() == [spec.name for spec in loaded.manifest.graph_inputs]


def test_manifest_file_content(mlp_adamw: Exported) -> None:
    data = json.loads((mlp_adamw.artifacts.directory / MANIFEST_NAME).read_text(encoding="utf-8"))
    assert data["format"] == "ort-lightning/artifacts"
    assert data["format_version"] == 1
    assert data["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["batch", 4]}]
    assert data["labels"] == [{"name": "labels", "dtype": "int64", "shape": ["batch"]}]
    assert data["outputs"] == ["logits"]
    assert data["loss"] == "cross_entropy"
    assert data["optimizer"] == "adamw"
    assert data["optimizer_options"] == {"betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert data["versions"] == {
        "ort_lightning": ort_lightning.__version__,
        "onnx": onnx.__version__,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
    assert data["versions"]["onnxruntime"] == "1.19.2"


def test_manifest_json_round_trip(mlp_adamw: Exported, bn_dropout_cnn: Exported) -> None:
    for manifest in (mlp_adamw.artifacts.manifest, bn_dropout_cnn.artifacts.manifest):
        assert Manifest.from_json(manifest.to_json(), Path("x.json")) == manifest
    assert bn_dropout_cnn.artifacts.manifest.graph_inputs == (
        TensorSpec("input", "float32", ("batch", 1, 8, 8)),
        TensorSpec("labels", "int64", ("batch",)),
    )


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        (TensorSpec("x", "float32", ("batch", 4)), torch.float32),
        (TensorSpec("ids", "int64", ("batch",)), torch.int64),
        (TensorSpec("mask", "bool", ("batch", 4)), torch.bool),
    ],
    ids=["float32", "int64", "bool"],
)
def test_tensor_spec_torch_dtype(spec: TensorSpec, dtype: torch.dtype) -> None:
    assert spec.torch_dtype == dtype


def test_tensor_spec_from_value_info() -> None:
    info = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3, 5])
    assert TensorSpec.from_value_info(info) == TensorSpec("x", "float32", ("batch", 3, 5))


# --- TrainingArtifacts.load errors ----------------------------------------------------------


def _remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def _write_manifest(text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / MANIFEST_NAME).write_text(text, encoding="utf-8")


def _edit_manifest(key: str, value: object) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        if value is None:
            del data[key]
        else:
            data[key] = value
        (folder / MANIFEST_NAME).write_text(json.dumps(data), encoding="utf-8")

    return edit


def _stamp_ir(graph: str, ir_version: int) -> Callable[[Path], None]:
    def stamp(folder: Path) -> None:
        proto = onnx.load(folder / graph)
        proto.ir_version = ir_version
        onnx.save(proto, folder / graph)

    return stamp


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (
            lambda folder: shutil.rmtree(folder),
            r"Artifacts folder .*artifacts does not exist; create it with",
        ),
        (_remove("training_model.onnx"), r"Artifact .*training_model\.onnx is missing; re-export"),
        (_remove("eval_model.onnx"), r"Artifact .*eval_model\.onnx is missing"),
        (_remove("optimizer_model.onnx"), r"Artifact .*optimizer_model\.onnx is missing"),
        (_remove("checkpoint"), r"Artifact .*checkpoint is missing"),
        (
            _write_manifest('{"name": "another program"}'),
            r"is not an ort-lightning manifest \(expected \"format\"",
        ),
        (_write_manifest("[1, 2, 3]"), r"is not an ort-lightning manifest"),
        (_write_manifest("{not json"), r"ort_lightning\.json is not valid JSON"),
        (_edit_manifest("format_version", 2), r"manifest format_version 2, this ort-lightning reads 1"),
        (_edit_manifest("labels", None), r"lacks or mangles the field 'labels'"),
        (
            _stamp_ir("training_model.onnx", 11),
            r"training_model\.onnx has ONNX IR version 11, .*reads IR <= 10",
        ),
        (_stamp_ir("eval_model.onnx", 11), r"eval_model\.onnx has ONNX IR version 11"),
        (_stamp_ir("optimizer_model.onnx", 12), r"optimizer_model\.onnx has ONNX IR version 12"),
        (
            lambda folder: (folder / "eval_model.onnx").write_bytes(b"\x00\xff" * 64),
            r"eval_model\.onnx is not a readable ONNX model",
        ),
    ],
    ids=[
        "missing-folder",
        "missing-training-model",
        "missing-eval-model",
        "missing-optimizer-model",
        "missing-checkpoint",
        "foreign-manifest",
        "manifest-not-an-object",
        "invalid-json",
        "future-format-version",
        "manifest-field-missing",
        "ir11-training-graph",
        "ir11-eval-graph",
        "ir12-optimizer-graph",
        "damaged-graph",
    ],
)
def test_load_errors(folder: Path, damage: Callable[[Path], None], match: str) -> None:
    damage(folder)
    with pytest.raises(ArtifactError, match=match):
        TrainingArtifacts.load(folder)


def test_load_refuses_a_file_given_as_folder(folder: Path) -> None:
    with pytest.raises(ArtifactError, match=r"training_model\.onnx is not a folder"):
        TrainingArtifacts.load(folder / "training_model.onnx")


def test_load_refuses_artifacts_generated_by_another_onnxruntime_release(mlp_adamw: Exported, tmp_path: Path) -> None:
    folder = shutil.copytree(mlp_adamw.artifacts.directory, tmp_path / "copy")
    manifest = folder / "ort_lightning.json"
    data = json.loads(manifest.read_text())
    data["versions"]["onnxruntime"] = "1.17.3"
    manifest.write_text(json.dumps(data))
    pattern = r"generated by onnxruntime 1\.17\.3, but 1\.19\.2 is installed.*re-export"
    with pytest.raises(ArtifactError, match=pattern):
        TrainingArtifacts.load(folder)
