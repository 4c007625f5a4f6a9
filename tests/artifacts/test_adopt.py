"""Folders written by ONNX Runtime's own ``generate_artifacts`` train under a Trainer exactly as ORT's documented loop.

The reference is ONNX Runtime's loop from its on-device training tutorials, run on a copy of the
folder: ``CheckpointState.load_checkpoint`` / ``Module`` / ``Optimizer`` / ``optimizer.step()`` /
``lazy_reset_grad()``, at the same constant learning rate (ort-lightning's default linear schedule
would decay it; the loop keeps it unless the device schedules it, hence ``lr_scheduler="constant"``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts
from ort_lightning.errors import ArtifactError, ConfigurationError
from tests.artifacts.generated import BATCH, CASES, LR, Case, Net, generate_folder, lightning_fit
from tests.helpers import ROOT, cli_error_line, ort_device_loop, quiet_trainer

STEPS = 3


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generated")
    return {case.name: generate_folder(case, root / case.name) for case in CASES}


def _batches(case: Case, count: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    result = []
    for _ in range(count):
        x = torch.randn(BATCH, 4, generator=generator)
        if case.label == "labels":
            result.append((x, torch.randint(0, 3, (BATCH,), generator=generator)))
        elif case.label == "target" and "BCE" in str(case.options.get("loss")):
            result.append((x, torch.rand(BATCH, 3, generator=generator)))
        elif case.label or case.own_loss:
            result.append((x, torch.randn(BATCH, 3, generator=generator)))
        else:
            result.append((x,))
    return result


def _params(module: ORTLightningModule) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy().copy() for name, tensor in module.named_parameters()}


def _copy(folder: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(folder, tmp_path / name))


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.iterdir()}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_trainer_equals_ort_loop(case: Case, folders: dict[str, Path], tmp_path: Path) -> None:
    folder = folders[case.name]
    before = _listing(folder)
    batches = _batches(case, STEPS)
    prefix = case.options.get("prefix", "")
    expected = ort_device_loop(_copy(folder, tmp_path, "reference"), batches, lr=LR, prefix=prefix)
    module = ORTLightningModule(folder, lr=LR, lr_scheduler="constant", labels=case.labels_arg)
    lightning_fit(module, batches)
    got = _params(module)
    assert sorted(got) == sorted(expected)
    moved = {name: float(np.abs(got[name] - ort_loop_start(folder, prefix)[name]).max()) for name in got}
    assert max(moved.values()) > 1e-4, "the run did not train at all"
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=name)
    assert _listing(folder) == before, "adopting a folder must not write into it"


def ort_loop_start(folder: Path, prefix: str) -> dict[str, np.ndarray]:
    state = CheckpointState.load_checkpoint(str(folder / f"{prefix}checkpoint"))
    return {name: np.array(parameter.data) for name, parameter in state.parameters}


def test_manifest_read_from_graphs(folders: dict[str, Path]) -> None:
    manifest = TrainingArtifacts.load(folders["head-only-frozen"]).manifest
    assert (manifest.trainable, manifest.frozen) == (("fc2.bias", "fc2.weight"), ("fc1.bias", "fc1.weight"))
    assert [s.name for s in manifest.inputs] == ["input"]
    assert [s.name for s in manifest.labels] == ["labels"]
    assert manifest.optimizer == "adamw"
    assert manifest.optimizer_options["epsilon"] == pytest.approx(1e-6)
    assert manifest.optimizer_options["adam_mode"] == 1
    assert TrainingArtifacts.load(folders["mse-sgd"]).manifest.optimizer == "sgd"
    assert TrainingArtifacts.load(folders["ort-only"]).manifest.optimizer == "adamw"
    assert TrainingArtifacts.load(folders["logits"]).manifest.outputs == ("logits",)
    assert TrainingArtifacts.load(folders["own-loss"]).manifest.labels == ()


def test_forward_gives_model_output(folders: dict[str, Path]) -> None:
    torch.manual_seed(0)
    reference = Net()  # the same seed made the exported model
    x = torch.randn(6, 4)
    module = ORTLightningModule(folders["logits"])
    torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-6)
    predicted = quiet_trainer().predict(module, DataLoader(TensorDataset(x), batch_size=3))
    torch.testing.assert_close(torch.cat(predicted), reference(x), rtol=1e-5, atol=1e-6)


def test_custom_loss_without_labels_is_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ArtifactError, match=r"cannot tell which are labels .*labels=\['my_target'\]"):
        ORTLightningModule(folders["custom-loss"])


def test_labels_not_in_graph_are_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ArtifactError, match=r"labels=\['target'\] names \['target'\], but training_model.onnx takes"):
        ORTLightningModule(folders["custom-loss"], labels=["target"])


def test_labels_of_an_exported_folder_must_be_its_manifests(tmp_path: Path) -> None:
    from ort_lightning import export_artifacts

    artifacts = export_artifacts(Net(), torch.zeros(2, 4), tmp_path / "exported", verify=False)
    same = TrainingArtifacts.load(artifacts.directory, labels=["labels"])
    assert [spec.name for spec in same.manifest.labels] == ["labels"]
    assert ORTLightningModule(artifacts, labels=["labels"]).artifacts.manifest.labels == same.manifest.labels
    refused = (r"labels=\['target'\] disagrees with the labels of .*exported: \['labels'\], recorded in its "
               r"ort_lightning.json \(model inputs \['input'\]\)\. Leave labels= out for an exported folder")
    with pytest.raises(ArtifactError, match=refused):
        ORTLightningModule(artifacts.directory, labels=["target"])
    with pytest.raises(ArtifactError, match=r"labels=\[\] disagrees with the labels of .*: \['labels'\]"):
        ORTLightningModule(artifacts, labels=[])


def test_folder_without_optimizer_evaluates_but_does_not_fit(tmp_path: Path) -> None:
    case = Case("no-optimizer", {"optimizer": None, "additional_output_names": ["logits"]})
    folder = generate_folder(case, tmp_path / "no-optimizer")
    module = ORTLightningModule(folder)
    batches = _batches(case, 2)
    data = DataLoader(TensorDataset(*(torch.cat(c) for c in zip(*batches, strict=True))), batch_size=BATCH)
    (result,) = quiet_trainer().validate(module, data)
    assert np.isfinite(result["val_loss"])
    with pytest.raises(ConfigurationError, match=r"has no optimizer graph .* but not fit"):
        quiet_trainer(max_steps=1).fit(module, data)


def test_hybrid_optimizer_on_adopted_folder(folders: dict[str, Path]) -> None:
    """ORT's gradients, torch's SGD: equals ORT's own SGD graph, which is plain ``w -= lr * g``."""
    case = next(c for c in CASES if c.name == "ce-sgd")
    batches = _batches(case, STEPS)
    expected = ort_device_loop(folders["ce-sgd"], batches, lr=LR)
    module = ORTLightningModule(folders["ce-adamw"], lr_scheduler="constant",
                                optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    lightning_fit(module, batches)
    for name, value in _params(module).items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_resume_from_ort_checkpoint(folders: dict[str, Path], tmp_path: Path) -> None:
    """3 steps, an ORT checkpoint with optimizer state, 2 more steps == 5 steps of ORT's loop."""
    case = next(c for c in CASES if c.name == "ce-adamw")
    batches = _batches(case, 5)
    expected = ort_device_loop(folders["ce-adamw"], batches, lr=LR)
    first = ORTLightningModule(folders["ce-adamw"], lr=LR, lr_scheduler="constant")
    lightning_fit(first, batches[:3])
    saved = first.save_ort_checkpoint(tmp_path / "last.ortckpt")
    second = ORTLightningModule(folders["ce-adamw"], lr=LR, lr_scheduler="constant", checkpoint=saved)
    lightning_fit(second, batches[3:])
    for name, value in _params(second).items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-6, err_msg=name)


def _bad(folders: dict[str, Path], tmp_path: Path, edit: Callable[[Path], None]) -> Path:
    folder = _copy(folders["ce-adamw"], tmp_path, "bad")
    edit(folder)
    return folder


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _nominal(folders: dict[str, Path], tmp_path: Path) -> Path:
    folder = generate_folder(Case("nominal", {"nominal_checkpoint": True}), tmp_path / "nominal")
    (folder / "checkpoint").unlink()
    (folder / "nominal_checkpoint").rename(folder / "checkpoint")
    return folder


def _disagreeing(folders: dict[str, Path], tmp_path: Path) -> Path:
    folder = _copy(folders["ort-format"], tmp_path, "disagree")
    shutil.copy(folders["head-only-constants"] / "eval_model.onnx", folder / "eval_model.onnx")
    return folder


#: What the ``ort-lightning`` console script runs (its entry point), in a child process.
CONSOLE_SCRIPT = "import sys; from ort_lightning.cli import main; sys.exit(main(sys.argv[1:]))"
#: Bad folders: how each is made from the session's good ones, and the one error line it must give.
BAD_FOLDERS: dict[str, tuple[Callable[[dict[str, Path], Path], Path], str]] = {
    "checkpoint-of-another-model": (
        lambda f, t: _bad(f, t, lambda d: shutil.copy(f["head-only-constants"] / "checkpoint", d / "checkpoint")),
        r"does not fit training_model.onnx: .* belongs to another model",
    ),
    "truncated-graph": (
        lambda f, t: _bad(f, t, lambda d: _truncate(d / "training_model.onnx", 100)),
        r"training_model.onnx is not a readable ONNX model",
    ),
    "truncated-checkpoint": (
        lambda f, t: _bad(f, t, lambda d: _truncate(d / "checkpoint", 64)),
        r"cannot read the checkpoint",
    ),
    "missing-graph": (
        lambda f, t: _bad(f, t, lambda d: (d / "eval_model.onnx").unlink()),
        r"has no eval_model.onnx or eval_model.ort; copy the whole folder",
    ),
    "nominal-checkpoint": (_nominal, r"cannot read the checkpoint .* nominal checkpoint \(no weights\)"),
    "ort-and-onnx-disagree": (_disagreeing, r"eval_model.ort and eval_model.onnx disagree: .* not the conversion"),
}


@pytest.mark.slow  # a child process per folder
@pytest.mark.parametrize("name", list(BAD_FOLDERS))
def test_bad_folder_gives_one_error_line_in_a_child_process(
    name: str, folders: dict[str, Path], tmp_path: Path
) -> None:
    """A child process loads the folder (``ort-lightning inspect``): a native crash in ONNX Runtime would end it
    with a signal and fail this test as a crash, not kill the test session."""
    make, pattern = BAD_FOLDERS[name]
    folder = make(folders, tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_SCRIPT, "inspect", str(folder)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode >= 0, f"killed by signal {-done.returncode}: {done.stderr[-2000:]}"
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    line = cli_error_line(done.stderr)
    assert re.match(rf"ort-lightning: error: ArtifactError: .*{pattern}", line), line


def test_export_folder_without_manifest_is_adopted_alike(tmp_path: Path) -> None:
    from ort_lightning import export_artifacts
    from ort_lightning.artifacts import MANIFEST_NAME

    own = export_artifacts(Net(), torch.zeros(2, 4), tmp_path / "own", verify=False).manifest
    (tmp_path / "own" / MANIFEST_NAME).unlink()
    adopted = TrainingArtifacts.load(tmp_path / "own").manifest
    assert (adopted.inputs, adopted.labels, adopted.outputs) == (own.inputs, own.labels, own.outputs)
    assert (set(adopted.trainable), adopted.optimizer) == (set(own.trainable), own.optimizer)


@pytest.mark.parametrize("name", ["ort-only", "prefix"])
def test_inspect_reads_generated_folder(name: str, folders: dict[str, Path]) -> None:
    from ort_lightning.cli.describe import describe

    shown = " ".join(describe(folders[name]).split())  # one space between the columns
    assert "written by: generate_artifacts folder" in shown
    prefix = "mobile_" if name == "prefix" else ""
    suffix = ".ort" if name == "ort-only" else ".onnx"
    for file in (f"{prefix}training_model{suffix}", f"{prefix}eval_model{suffix}", f"{prefix}checkpoint"):
        size = (folders[name] / file).stat().st_size
        number, unit = re.search(rf"device file: {file} \(([\d.,]+) (B|kB)\)", shown).groups()  # type: ignore[union-attr]
        assert float(number.replace(",", "")) * (1000 if unit == "kB" else 1) == pytest.approx(size, abs=50)
    assert f"{4 * 5 + 5 + 5 * 3 + 3:,} values" in shown  # the Net's parameters, counted here
    if name == "ort-only":  # generate_artifacts' default AdamW, as the .ort graph's node says (flatbuffers)
        expected = "epsilon=1e-06 weight_decay=0.0 correct_bias=1 beta=0.999 alpha=0.9 adam_mode=1"
        assert f"optimizer: adamw {expected}" in shown


def test_optimizer_attributes_of_ort_graphs_are_those_of_the_onnx_graphs(folders: dict[str, Path]) -> None:
    from ort_lightning.artifacts.adopted import optimizer_attributes
    from ort_lightning.ort import runtime

    folder = folders["ort-format"]  # both formats, from one generate_artifacts(..., ort_format=True) run
    from_onnx = optimizer_attributes(folder / "optimizer_model.onnx")
    assert from_onnx
    assert optimizer_attributes(folder / "optimizer_model.ort") == from_onnx
    with pytest.raises(ArtifactError, match=r"training_model.onnx is not an ONNX Runtime .ort graph"):
        runtime.ort_node_attributes(folder / "training_model.onnx", ["AdamWOptimizer"])


def test_forward_without_model_outputs_is_refused(folders: dict[str, Path]) -> None:
    module = ORTLightningModule(folders["ce-adamw"])  # generated without additional_output_names
    with pytest.raises(ConfigurationError, match=r"eval_model.onnx outputs the loss only, .*additional_output_names"):
        module(torch.zeros(2, 4))


def test_ort_checkpoint_callback_on_adopted_folder(folders: dict[str, Path], tmp_path: Path) -> None:
    """ORTCheckpoint's last.ortckpt after 3 steps, continued 2 steps by ORT's loop == 5 steps of ORT's loop."""
    from ort_lightning import ORTCheckpoint

    case = next(c for c in CASES if c.name == "ce-adamw")
    batches = _batches(case, 5)
    expected = ort_device_loop(folders["ce-adamw"], batches, lr=LR)
    module = ORTLightningModule(folders["ce-adamw"], lr=LR, lr_scheduler="constant")
    data = TensorDataset(*(torch.cat(column) for column in zip(*batches[:3], strict=True)))
    trainer = quiet_trainer(max_steps=3, callbacks=[ORTCheckpoint(tmp_path / "ckpts", every_n_train_steps=3)])
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    continued = ort_device_loop(folders["ce-adamw"], batches[3:], lr=LR, checkpoint=tmp_path / "ckpts" / "last.ortckpt")
    for name, value in expected.items():
        np.testing.assert_allclose(continued[name], value, rtol=0, atol=1e-6, err_msg=name)


def test_lightning_ckpt_of_custom_loss_folder_reloads_with_its_labels(folders: dict[str, Path], tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "custom-loss")
    batches = _batches(case, 2)
    module = ORTLightningModule(folders["custom-loss"], lr=LR, lr_scheduler="constant", labels=["my_target"])
    data = TensorDataset(*(torch.cat(column) for column in zip(*batches, strict=True)))
    trainer = quiet_trainer(max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    (saved,) = tmp_path.rglob("*.ckpt")
    reloaded = ORTLightningModule.load_from_checkpoint(saved)
    assert [spec.name for spec in reloaded.artifacts.manifest.labels] == ["my_target"]
    for (name, tensor), (_, original) in zip(reloaded.named_parameters(), module.named_parameters(), strict=True):
        torch.testing.assert_close(tensor, original, rtol=0, atol=0, msg=name)


@pytest.mark.slow  # two DDP ranks
def test_ort_ddp_on_adopted_folder_equals_ort_loop_on_double_batch(folders: dict[str, Path], tmp_path: Path) -> None:
    """Two gloo ranks of batch 4 (strategy="ort_ddp") == ORT's loop with batch 8, the ranks' samples in order."""
    import subprocess
    import sys

    from tests.strategies import ddp_run

    steps = 4
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "tests.strategies.ddp_run", str(folders["ce-adamw"]), str(out), "--devices=2",
               "--batch=4", f"--steps={steps}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    x, y = ddp_run.dataset("mlp", steps * 8)
    expected = ort_device_loop(folders["ce-adamw"], [(x[i:i + 8], y[i:i + 8]) for i in range(0, steps * 8, 8)], lr=0.01)
    for rank in (0, 1):
        state = ddp_run.load(out, rank)["state"]
        for name, value in expected.items():
            np.testing.assert_allclose(state[name].numpy(), value, rtol=0, atol=1e-6, err_msg=f"rank {rank} {name}")
