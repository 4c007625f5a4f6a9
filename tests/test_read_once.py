"""One operation reads each graph and checkpoint file at most once, and passes what it read down.

The reads are counted where onnx and ONNX Runtime do them (``onnx.load``,
``CheckpointState.load_checkpoint``), wrapped by counters that still read the files; each
operation runs on a fresh copy of the artifacts, so that no earlier test's read is reused.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from onnxruntime.training.api import CheckpointState

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.artifacts import checks
from ort_lightning.fleet.devices.state_values import get_values
from ort_lightning.fleet.server.global_model import GlobalModel
from tests.conftest import Exported


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """File name -> how often onnx or ONNX Runtime read it from now on."""
    counted: Counter[str] = Counter()
    load, load_checkpoint = onnx.load, CheckpointState.load_checkpoint

    def counted_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        counted[Path(os.fspath(f)).name if isinstance(f, str | os.PathLike) else type(f).__name__] += 1
        return load(f, *args, **kwargs)

    def counted_checkpoint(path: Any, *args: Any, **kwargs: Any) -> Any:
        counted[Path(os.fspath(path)).name] += 1
        return load_checkpoint(path, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counted_load)
    monkeypatch.setattr(CheckpointState, "load_checkpoint", staticmethod(counted_checkpoint))
    return counted


def _copy(exported: Exported, target: Path) -> Path:
    return Path(shutil.copytree(exported.artifacts.directory, target))


GRAPHS = {"training_model.onnx": 1, "eval_model.onnx": 1, "optimizer_model.onnx": 1}


def test_a_module_reads_each_file_once(mlp_adamw: Exported, tmp_path: Path, reads: Counter[str]) -> None:
    ORTLightningModule(_copy(mlp_adamw, tmp_path / "artifacts"))
    assert dict(reads) == {**GRAPHS, "checkpoint": 1}


def test_a_module_from_a_checkpoint_reads_it_once(mlp_adamw: Exported, tmp_path: Path, reads: Counter[str]) -> None:
    path = ORTLightningModule(mlp_adamw.artifacts).save_ort_checkpoint(tmp_path / "state.ortckpt")
    folder = _copy(mlp_adamw, tmp_path / "artifacts")
    reads.clear()
    ORTLightningModule(folder, checkpoint=path)
    # NOTE: the artifacts' own checkpoint is read once too: the given file's parameters are checked against it.
    assert dict(reads) == {**GRAPHS, "state.ortckpt": 1, "checkpoint": 1}


def test_values_with_a_kept_optimizer_state_read_it_once(
    mlp_adamw: Exported, tmp_path: Path, reads: Counter[str]
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    path = module.save_ort_checkpoint(tmp_path / "state.ortckpt")
    reads.clear()
    module.load_values(get_values(module), optimizer_state=path)
    assert reads["state.ortckpt"] == 1


@pytest.mark.parametrize("verify", [False, True], ids=["unverified", "verified"])
def test_an_export_reads_each_graph_once(tmp_path: Path, reads: Counter[str], verify: bool) -> None:
    # NOTE: the passes after generation read each graph once; the verifier's job and the folder check take them
    # as they were written (the verifier's child process reads its own copy: another process, not counted here).
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    export_artifacts(model, torch.zeros(2, 4), tmp_path / "artifacts", verify=verify)
    assert dict(reads) == GRAPHS


@pytest.mark.parametrize("remembered", [checks._KNOWN_LIMIT - 3, checks._KNOWN_LIMIT - 2, checks._KNOWN_LIMIT - 1])
def test_an_export_after_many_others_reads_each_graph_once(
    tmp_path: Path, reads: Counter[str], monkeypatch: pytest.MonkeyPatch, remembered: int
) -> None:
    # A process that exported before holds other graphs' facts: the export's own three must stay among them.
    monkeypatch.setattr(checks, "_KNOWN", {})
    graph = onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [], []))
    for index in range(remembered):
        path = tmp_path / f"earlier_{index}.onnx"
        onnx.save(graph, path)
        checks.remember_graph(path, graph)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    export_artifacts(model, torch.zeros(2, 4), tmp_path / "artifacts", verify=False)
    assert dict(reads) == GRAPHS


def test_a_fleet_start_reads_each_file_once(mlp_adamw: Exported, tmp_path: Path, reads: Counter[str]) -> None:
    GlobalModel(_copy(mlp_adamw, tmp_path / "artifacts"))
    assert dict(reads) == {**GRAPHS, "checkpoint": 1}


def test_a_resumed_fleet_start_reads_the_round_once(mlp_adamw: Exported, tmp_path: Path, reads: Counter[str]) -> None:
    path = GlobalModel(mlp_adamw.artifacts).save(tmp_path / "round-0003.ortckpt", server_round=3)
    folder = _copy(mlp_adamw, tmp_path / "artifacts")
    reads.clear()
    resumed = GlobalModel(folder, checkpoint=path)
    # NOTE: the round's number comes from the one read that checked the file and built the session.
    assert resumed.server_round == 3
    assert dict(reads) == {**GRAPHS, "round-0003.ortckpt": 1, "checkpoint": 1}
