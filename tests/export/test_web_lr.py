"""``prepare_for_web``: a folder whose optimizer graph computes its own learning rate trains at it in any ORT build.

References: ONNX Runtime's documented Python loop (``CheckpointState`` / ``Module`` / ``Optimizer``) on
the prepared ``.ort`` graphs with no ``set_learning_rate`` call, as onnxruntime-web runs them; the
same model in plain torch with torch's AdamW or SGD and a ``LambdaLR`` of the closed form written
here. ``ORTLightningModule`` on the original folder must equal the first; the second checks the rates.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts
from ort_lightning.artifacts import MANIFEST_NAME
from ort_lightning.artifacts.schedule import GraphSchedule
from ort_lightning.cli.describe import describe
from ort_lightning.errors import ConfigurationError, ExportError
from ort_lightning.export import prepare_for_web
from tests.conftest import Exported, blobs
from tests.helpers import ort_device_loop
from tests.step_reference import trainer

pytestmark = [pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*")]

STEPS, BATCH = 10, 8
#: Settings of ORTLightningModule and prepare_for_web alike; the linear one runs past its end (T=8 < STEPS).
SCHEDULES: dict[str, dict[str, Any]] = {
    "constant": dict(lr=0.01, lr_scheduler="constant"),
    "linear": dict(lr=0.05, lr_scheduler="linear", warmup_steps=3, total_steps=8),
}
OPTIMIZERS = ("adamw", "sgd")
CASES = [(optimizer, schedule) for optimizer in OPTIMIZERS for schedule in SCHEDULES]
IDS = [f"{optimizer}-{schedule}" for optimizer, schedule in CASES]


def _closed_form(step: int, warmup: int, total: int) -> float:
    """The linear schedule's factor after `step` completed optimizer steps, written here independently."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


@pytest.fixture(scope="module")
def exported(mlp_adamw: Exported, mlp_sgd: Exported) -> dict[str, Exported]:
    return {"adamw": mlp_adamw, "sgd": mlp_sgd}


@pytest.fixture(scope="module")
def prepared(exported: dict[str, Exported], tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainingArtifacts]:
    root = tmp_path_factory.mktemp("web")
    return {f"{optimizer}-{schedule}": prepare_for_web(exported[optimizer].artifacts, root / f"{optimizer}-{schedule}",
                                                       **SCHEDULES[schedule])
            for optimizer, schedule in CASES}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = blobs(STEPS * BATCH, seed=5)
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, STEPS * BATCH, BATCH)]


def lightning_fit(module: ORTLightningModule, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    x, y = (torch.cat(column) for column in zip(*batches, strict=True))
    trainer(len(batches), []).fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))


def torch_fit(model: torch.nn.Module, optimizer: str, settings: dict[str, Any],
              batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Plain torch: the optimizer with torch's defaults (ORT's SGD is plain SGD), LambdaLR of the closed form."""
    lr = settings["lr"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr) if optimizer == "adamw" else torch.optim.SGD(
        model.parameters(), lr=lr)
    factor: Callable[[int], float] = (lambda s: 1.0) if settings["lr_scheduler"] == "constant" else (
        lambda s: _closed_form(s, settings["warmup_steps"], settings["total_steps"]))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    used = []
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        schedule.step()
    return used


# ----------------------------------------------------------------------------- the rates
@pytest.mark.parametrize(("optimizer", "schedule"), CASES, ids=IDS)
def test_ort_loop_without_an_lr_equals_the_module_on_the_original_folder(
    exported: dict[str, Exported], prepared: dict[str, TrainingArtifacts], optimizer: str, schedule: str
) -> None:
    batches = _batches()
    device = ort_device_loop(prepared[f"{optimizer}-{schedule}"].directory, batches, lr=None, graphs="ort")
    module = ORTLightningModule(exported[optimizer].artifacts, **SCHEDULES[schedule])
    lightning_fit(module, batches)
    for name, tensor in module.named_parameters():
        np.testing.assert_allclose(device[name], tensor.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)
    # and the rates themselves: plain torch at the closed-form schedule
    reference = exported[optimizer].reference()
    used = torch_fit(reference, optimizer, SCHEDULES[schedule], batches)
    if schedule == "linear":
        assert used == pytest.approx([0.0, 0.05 / 3, 0.1 / 3, 0.05, 0.04, 0.03, 0.02, 0.01, 0.0, 0.0])
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(device[name], parameter.detach().numpy(), rtol=0, atol=2e-5, err_msg=name)


def test_a_plain_folder_trains_at_orts_default_rate_without_an_lr(mlp_adamw: Exported) -> None:
    """What docs/browsers.md says a plain folder does in a browser: ORT's default 1e-3."""
    batches = _batches()
    device = ort_device_loop(mlp_adamw.artifacts.directory, batches, lr=None, graphs="onnx")
    reference = mlp_adamw.reference()
    torch_fit(reference, "adamw", dict(lr=1e-3, lr_scheduler="constant"), batches)
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(device[name], parameter.detach().numpy(), rtol=0, atol=1e-5, err_msg=name)


def test_the_onnx_and_ort_graphs_agree(prepared: dict[str, TrainingArtifacts]) -> None:
    folder = prepared["adamw-linear"].directory
    batches = _batches()
    on_ort = ort_device_loop(folder, batches, lr=None, graphs="ort")
    on_onnx = ort_device_loop(folder, batches, lr=None, graphs="onnx")
    for name, value in on_onnx.items():
        np.testing.assert_array_equal(on_ort[name], value, err_msg=name)


# ----------------------------------------------------------------------------- the folder
def test_the_device_folder_is_complete_and_its_graphs_valid(
    mlp_adamw: Exported, prepared: dict[str, TrainingArtifacts]
) -> None:
    web = prepared["adamw-linear"]
    names = {path.name for path in web.directory.iterdir()}
    assert {"training_model.ort", "eval_model.ort", "optimizer_model.ort", "nominal_checkpoint", "checkpoint",
            MANIFEST_NAME} <= names
    optimizer = onnx.load(web.optimizer_model)
    onnx.checker.check_model(optimizer, full_check=True)
    assert [value.name for value in optimizer.graph.input][:2] == ["learning_rate", "step"]
    recorded = json.loads((web.directory / MANIFEST_NAME).read_text())["lr_schedule"]
    assert recorded == {"kind": "linear", "lr": 0.05, "warmup_steps": 3, "total_steps": 8}
    for role in ("training_model", "eval_model"):
        assert getattr(web, role).read_bytes() == getattr(mlp_adamw.artifacts, role).read_bytes()
    assert mlp_adamw.artifacts.manifest.lr_schedule is None


def test_a_fractional_warmup_is_rounded_as_the_module_rounds_it(mlp_sgd: Exported, tmp_path: Path) -> None:
    web = prepare_for_web(mlp_sgd.artifacts, tmp_path / "web", lr=0.1, lr_scheduler="linear", warmup_steps=0.25,
                          total_steps=10, ort_format=False)
    assert web.manifest.lr_schedule is not None
    assert web.manifest.lr_schedule.warmup_steps == round(0.25 * 10) == 2
    assert not list(web.directory.glob("*.ort"))


def test_preparing_again_replaces_the_earlier_device_folder(mlp_sgd: Exported, tmp_path: Path) -> None:
    prepare_for_web(mlp_sgd.artifacts, tmp_path / "web", lr=0.1, ort_format=False)
    again = prepare_for_web(mlp_sgd.artifacts, tmp_path / "web", lr=0.2, ort_format=False)
    assert again.manifest.lr_schedule is not None
    assert again.manifest.lr_schedule.lr == 0.2
    assert sorted(path.name for path in tmp_path.iterdir()) == ["web"]  # no staging folder left behind


# ----------------------------------------------------------------------------- inspect
@pytest.mark.parametrize(("case", "line"), [
    ("adamw-linear", "linear warmup 3 steps to 0.05, decay to 0 at step 8, computed in the optimizer graph"),
    ("sgd-constant", "constant 0.01, computed in the optimizer graph"),
    ("plain", "fed by the runtime (onnxruntime-web trains such a folder at ORT's default 1e-3)"),
], ids=["linear", "constant", "plain"])
def test_inspect_says_where_the_learning_rate_comes_from(
    mlp_adamw: Exported, prepared: dict[str, TrainingArtifacts], case: str, line: str
) -> None:
    folder = mlp_adamw.artifacts.directory if case == "plain" else prepared[case].directory
    rows = [row for row in describe(folder).splitlines() if row.startswith("learning rate:")]
    assert len(rows) == 1
    assert rows[0].split(":", 1)[1].strip() == line


# ----------------------------------------------------------------------------- errors
BAD_SCHEDULES = [
    (dict(lr=0.0), r"Expected `lr` to be a positive float, but got 0\.0; pass the peak rate"),
    (dict(lr=0.01, lr_scheduler="cosine"), r"Expected `lr_scheduler` to be one of \['constant', 'linear'\], but got "
                                           r"'cosine'; a device folder computes only these"),
    (dict(lr=0.01, warmup_steps=2), r"lr_scheduler='constant' takes no warmup_steps or total_steps, but got "
                                    r"warmup_steps=2, total_steps=None; leave them out"),
    (dict(lr=0.01, lr_scheduler="linear"), r"lr_scheduler='linear' needs `total_steps`, a positive int, but got None;"
                                           r" ORTLightningModule's total_steps=None means the Trainer's "
                                           r"estimated_stepping_batches, and a device has no Trainer"),
    (dict(lr=0.01, lr_scheduler="linear", total_steps=8, warmup_steps=-1),
     r"Expected `warmup_steps` as a count \(int >= 0\) or a fraction in \(0, 1\) of total_steps, but got -1"),
]


@pytest.mark.parametrize(("options", "message"), BAD_SCHEDULES,
                         ids=["lr", "scheduler", "constant-warmup", "linear-total", "warmup"])
def test_a_bad_schedule_is_refused(mlp_sgd: Exported, tmp_path: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ExportError, match=message):
        prepare_for_web(mlp_sgd.artifacts, tmp_path / "web", **options)
    assert not (tmp_path / "web").exists()


def test_a_prepared_folder_is_not_prepared_again(prepared: dict[str, TrainingArtifacts], tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"already computes its learning rate in its optimizer graph \(constant "
                                          r"0\.01, computed in the optimizer graph\); pass the folder that "
                                          r"export_artifacts\(\) wrote"):
        prepare_for_web(prepared["sgd-constant"], tmp_path / "again", lr=0.1)


def test_the_output_must_not_be_the_source_or_a_foreign_folder(mlp_sgd: Exported, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"is the folder being prepared; pass another folder"):
        prepare_for_web(mlp_sgd.artifacts, mlp_sgd.artifacts.directory, lr=0.1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match=r"exists and holds files that prepare_for_web\(\) did not write; pass a new"):
        prepare_for_web(mlp_sgd.artifacts, tmp_path / "mine", lr=0.1)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_folder_without_onnx_graphs_is_refused(
    mlp_adamw: Exported, prepared: dict[str, TrainingArtifacts], tmp_path: Path
) -> None:
    folder = tmp_path / "ort-only"
    folder.mkdir()
    for name in ("checkpoint", MANIFEST_NAME):
        shutil.copyfile(mlp_adamw.artifacts.directory / name, folder / name)
    for path in prepared["adamw-constant"].directory.glob("*.ort"):
        shutil.copyfile(path, folder / path.name)
    with pytest.raises(ExportError, match=r"has no training_model\.onnx, eval_model\.onnx, optimizer_model\.onnx: "
                                          r"prepare_for_web\(\) rewrites the optimizer graph in ONNX"):
        prepare_for_web(folder, tmp_path / "web", lr=0.1)


def test_a_linear_schedule_needs_the_step_input(mlp_sgd: Exported, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(mlp_sgd.artifacts.directory, tmp_path / "no-step"))
    graph = onnx.load(folder / "optimizer_model.onnx")
    kept = [value for value in graph.graph.input if value.name != "step"]
    del graph.graph.input[:]
    graph.graph.input.extend(kept)
    onnx.save(graph, folder / "optimizer_model.onnx")
    with pytest.raises(ExportError, match=r"The optimizer graph has no 'step' input .*use lr_scheduler='constant'"):
        prepare_for_web(folder, tmp_path / "web", lr=0.1, lr_scheduler="linear", total_steps=4)
    constant = prepare_for_web(folder, tmp_path / "web", lr=0.1, ort_format=False)
    assert constant.manifest.lr_schedule is not None


# ----------------------------------------------------------------------------- the module on a prepared folder
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_module_trains_a_prepared_folder_at_its_schedule(
    exported: dict[str, Exported], prepared: dict[str, TrainingArtifacts], schedule: str
) -> None:
    """Given the folder's own settings, the module reports the rate the graph computes: ORT's loop without an lr."""
    web = prepared[f"adamw-{schedule}"]
    batches = _batches()
    module = ORTLightningModule(web, **SCHEDULES[schedule])
    lightning_fit(module, batches)
    device = ort_device_loop(web.directory, batches, lr=None, graphs="ort")
    for name, tensor in module.named_parameters():
        np.testing.assert_allclose(device[name], tensor.detach().numpy(), rtol=0, atol=1e-6, err_msg=name)


OTHER_SETTINGS = [
    ("adamw-linear", dict(), r"lr=0\.001, lr_scheduler='linear', warmup_steps=0, total_steps=None: it would report "
                             r"one rate and train at another\. Pass lr=0\.05, lr_scheduler='linear', warmup_steps=3, "
                             r"total_steps=8 to train at the folder's schedule"),
    ("adamw-linear", dict(lr=0.05, lr_scheduler="linear", warmup_steps=3, total_steps=9), r"total_steps=9: it would"),
    ("adamw-linear", dict(lr=0.05, lr_scheduler="constant"), r"lr_scheduler='constant'.*Pass lr=0\.05, "
                                                             r"lr_scheduler='linear'"),
    ("sgd-constant", dict(lr=0.02, lr_scheduler="constant"), r"\(constant 0\.01, computed in the optimizer graph; "
                                                             r"prepare_for_web\(\) wrote it\) and ignores the rate "
                                                             r"ORTLightningModule sets.*Pass lr=0\.01, "
                                                             r"lr_scheduler='constant' to train"),
    ("sgd-constant", dict(lr=0.01, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2)),
     r"lr_scheduler='<lambda>'"),
]


@pytest.mark.parametrize(("case", "options", "message"), OTHER_SETTINGS,
                         ids=["defaults", "other-total", "other-kind", "other-lr", "torch-scheduler"])
def test_the_module_refuses_another_schedule_on_a_prepared_folder(
    prepared: dict[str, TrainingArtifacts], case: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=r"computes its learning rate in its optimizer graph .*" + message):
        ORTLightningModule(prepared[case], **options)


def test_skipping_steps_is_refused_under_a_linear_graph_schedule(prepared: dict[str, TrainingArtifacts]) -> None:
    with pytest.raises(ConfigurationError, match=r"from ONNX Runtime's count of updates, which a skipped step does not "
                                                 r"advance.*Pass on_nonfinite='raise'"):
        ORTLightningModule(prepared["adamw-linear"], **SCHEDULES["linear"], on_nonfinite="skip")
    ORTLightningModule(prepared["adamw-constant"], **SCHEDULES["constant"], on_nonfinite="skip")


def test_a_hybrid_module_ignores_the_graphs_schedule(prepared: dict[str, TrainingArtifacts]) -> None:
    """A torch optimizer over ORT's gradients never runs the optimizer graph: its own rate holds."""
    batches = _batches()[:3]
    module = ORTLightningModule(prepared["adamw-linear"], lr_scheduler="constant",
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    before = {name: tensor.detach().clone() for name, tensor in module.named_parameters()}
    lightning_fit(module, batches)
    reference = {name: tensor.clone().requires_grad_(True) for name, tensor in before.items()}
    sgd = torch.optim.SGD(reference.values(), lr=0.1)
    for x, y in batches:
        hidden = torch.relu(x @ reference["fc1.weight"].T + reference["fc1.bias"])
        F.cross_entropy(hidden @ reference["fc2.weight"].T + reference["fc2.bias"], y).backward()
        sgd.step()
        sgd.zero_grad()
    for name, tensor in module.named_parameters():
        torch.testing.assert_close(tensor.detach(), reference[name].detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("suffix", [".ort", ".onnx"])
def test_a_copy_without_manifest_still_tells_its_schedule(
    prepared: dict[str, TrainingArtifacts], tmp_path: Path, suffix: str
) -> None:
    """A device's copy of the graphs alone: the optimizer graph's metadata records the schedule."""
    source = prepared["adamw-linear"].directory
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in [*source.glob(f"*{suffix}"), source / "checkpoint"]:
        shutil.copyfile(path, copy / path.name)
    adopted = TrainingArtifacts.load(copy)
    assert adopted.adopted
    assert adopted.manifest.lr_schedule == GraphSchedule("linear", 0.05, warmup_steps=3, total_steps=8)
    assert "linear warmup 3 steps to 0.05" in describe(copy)
    with pytest.raises(ConfigurationError, match=r"computes its learning rate in its optimizer graph"):
        ORTLightningModule(copy, lr=0.05)
