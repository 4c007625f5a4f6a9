"""A device folder (the graphs and the nominal checkpoint, no weights) trains under a Trainer as ONNX Runtime's loop.

What a device ships is the training, eval and optimizer graphs (``.onnx`` or ``.ort``) and the
``nominal_checkpoint``; the complete checkpoint stays with the server, which sends the weights.
The reference is ONNX Runtime's documented start of such a device, run on the same files:
``CheckpointState.load_checkpoint(nominal)``, ``Module``, ``copy_buffer_to_parameters`` (every state
tensor, in the training graph's input order as ONNX Runtime reports it), ``Optimizer``, then
``train_step`` / ``optimizer.step()`` / ``lazy_reset_grad()`` at a constant learning rate.
"""

from __future__ import annotations

import copy
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from onnxruntime.training.api import CheckpointState

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.cli.describe import describe
from ort_lightning.errors import ArtifactError, ConfigurationError
from ort_lightning.fleet import get_values
from tests.artifacts.generated import BATCH, LR, Case, Net, generate_folder, lightning_fit
from tests.helpers import ort_device_loop

STEPS = 4


@dataclass(frozen=True)
class Shipped:
    """A complete folder (the server's) and the device folder made from it."""

    complete: Path
    device: Path
    prefix: str = ""


def _device_copy(folder: Path, device: Path, *, drop_onnx: bool) -> Path:
    """What a device holds: the folder without its complete checkpoint (and without the .onnx graphs)."""
    shutil.copytree(folder, device)
    for path in device.iterdir():
        complete = path.name.endswith("checkpoint") and not path.name.endswith("nominal_checkpoint")
        if complete or (drop_onnx and path.suffix == ".onnx"):
            path.unlink()
    return device


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Shipped:
    """``export_artifacts(..., nominal_checkpoint=True, ort_format=True)``, shipped: .ort graphs, the nominal file."""
    root = tmp_path_factory.mktemp("exported")
    torch.manual_seed(0)
    export_artifacts(Net(), torch.zeros(2, 4), root / "server", verify=False, ort_format=True, nominal_checkpoint=True)
    return Shipped(root / "server", _device_copy(root / "server", root / "device", drop_onnx=True))


#: generate_artifacts folders: .onnx graphs; .ort graphs only under a prefix; a frozen first layer.
GENERATED = [
    Case("onnx", {"nominal_checkpoint": True}),
    Case("ort-prefix", {"nominal_checkpoint": True, "ort_format": True, "prefix": "mobile_"}, onnx_removed=True),
    Case("frozen", {"nominal_checkpoint": True, "requires_grad": ["fc2.weight", "fc2.bias"],
                    "frozen_params": ["fc1.weight", "fc1.bias"]}),
]


@pytest.fixture(scope="module", params=GENERATED, ids=[case.name for case in GENERATED])
def generated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Shipped:
    case: Case = request.param
    root = tmp_path_factory.mktemp(f"generated-{case.name}")
    server = generate_folder(Case(case.name, case.options), root / "server")
    device = _device_copy(server, root / "device", drop_onnx=case.onnx_removed)
    return Shipped(server, device, case.options.get("prefix", ""))


def _batches(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 4, generator=generator), torch.randint(0, 3, (BATCH,), generator=generator))
            for _ in range(count)]


def _server_values(shipped: Shipped) -> dict[str, torch.Tensor]:
    """What a server sends: the values of a module on the complete folder after two steps of its own."""
    server = ORTLightningModule(TrainingArtifacts.load(shipped.complete), lr=LR, lr_scheduler="constant")
    lightning_fit(server, _batches(2, seed=21))
    return get_values(server)


def _assert_trains_as_orts_loop(
    shipped: Shipped, tmp_path: Path
) -> tuple[ORTLightningModule, dict[str, torch.Tensor]]:
    """Lightning on the device folder with the server's values == ORT's device loop on a copy of its files."""
    values = _server_values(shipped)
    batches = _batches(STEPS, seed=3)
    module = ORTLightningModule(shipped.device, values=values, lr=LR, lr_scheduler="constant")
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        assert torch.equal(tensor.detach(), values[name]), f"{name} is not the server's value"
    lightning_fit(module, batches)
    reference = Path(shutil.copytree(shipped.device, tmp_path / "reference"))  # the same files, read apart
    expected = ort_device_loop(reference, batches, lr=LR, prefix=shipped.prefix, values=values)
    trained = dict(module.named_parameters())
    assert sorted(trained) == sorted(expected)
    moved = max(float(np.abs(expected[name] - values[name].numpy()).max()) for name in expected)
    assert moved > 1e-3, "the reference did not train"
    for name, value in expected.items():
        np.testing.assert_allclose(trained[name].detach().numpy(), value, rtol=0, atol=1e-6, err_msg=name)
    return module, values


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor:
    return dict(module.named_parameters())[name].detach()


# ----------------------------------------------------------------------------- the folders load
def test_export_device_folder_is_weightless(exported: Shipped) -> None:
    names = sorted(path.name for path in exported.device.iterdir())
    assert "checkpoint" not in names, names
    assert not any(name.endswith(".onnx") for name in names), names
    artifacts = TrainingArtifacts.load(exported.device)
    complete = TrainingArtifacts.load(exported.complete)
    assert (artifacts.weightless, complete.weightless, artifacts.adopted) == (True, False, False)
    assert artifacts.training_model.name == "training_model.ort"
    assert artifacts.nominal_checkpoint == exported.device / "nominal_checkpoint"
    assert artifacts.manifest == complete.manifest


def test_generated_device_folder_reads_trainable_and_frozen_from_the_graph(generated: Shipped) -> None:
    """ORT reads no requires_grad from a nominal checkpoint; the graph's gradient buffers tell the same split."""
    device = TrainingArtifacts.load(generated.device)
    complete = TrainingArtifacts.load(generated.complete)
    assert (device.weightless, device.adopted) == (True, True)
    assert device.nominal_checkpoint == generated.device / f"{generated.prefix}nominal_checkpoint"
    assert (device.manifest.trainable, device.manifest.frozen) == (complete.manifest.trainable,
                                                                   complete.manifest.frozen)
    # NOTE: an .ort optimizer graph's attributes are not readable (optimizer_options stay empty); all else agrees
    assert replace(device.manifest, optimizer_options={}) == replace(complete.manifest, optimizer_options={})


# ----------------------------------------------------------------------------- they train as ORT's loop
def test_export_device_folder_trains_as_orts_loop(exported: Shipped, tmp_path: Path) -> None:
    module, _ = _assert_trains_as_orts_loop(exported, tmp_path)
    # a pickled copy (DDP spawn, deepcopy) is rebuilt from its own values: the folder has none
    twin = copy.deepcopy(module)
    for (name, tensor), (_, copied) in zip(module.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.equal(tensor, copied), name
        assert tensor.data_ptr() != copied.data_ptr(), name
    # what it saves is complete: a later run starts from it without values, on the same device folder
    saved = module.save_ort_checkpoint(tmp_path / "trained.ortckpt")
    resumed = ORTLightningModule(exported.device, checkpoint=saved)
    for name, tensor in module.named_parameters():
        assert torch.equal(_parameter(resumed, name), tensor.detach()), name


def test_generated_device_folder_trains_as_orts_loop(generated: Shipped, tmp_path: Path) -> None:
    module, values = _assert_trains_as_orts_loop(generated, tmp_path)
    for name in TrainingArtifacts.load(generated.device).manifest.frozen:  # they keep the server's values
        assert torch.equal(_parameter(module, name), values[name]), name


# ----------------------------------------------------------------------------- what is refused, and inspect
def test_device_folder_without_values_is_refused_by_name(exported: Shipped, generated: Shipped) -> None:
    for shipped in (exported, generated):
        folder = re.escape(str(shipped.device))
        message = (rf"{folder} holds no weights: its only checkpoint is .*nominal_checkpoint \(names and shapes, "
                   r"what a device ships\), so there is nothing to start from; pass the weights with "
                   r"ORTLightningModule\(folder, values=\{name: tensor\}\)")
        with pytest.raises(ConfigurationError, match=message):
            ORTLightningModule(shipped.device)
        with pytest.raises(ArtifactError, match=rf"{folder} holds no weights: .* no complete checkpoint to read"):
            TrainingArtifacts.load(shipped.device).checkpoint  # noqa: B018 - reading it is the check


def test_folder_without_either_checkpoint_or_with_weights_in_the_nominal_one_is_refused(
    generated: Shipped, tmp_path: Path
) -> None:
    none = Path(shutil.copytree(generated.device, tmp_path / "none"))
    (none / f"{generated.prefix}nominal_checkpoint").unlink()
    with pytest.raises(ArtifactError, match=r"has no (mobile_)?checkpoint \(the weights\) and no "
                                            r"(mobile_)?nominal_checkpoint \(a device's weightless one\)"):
        TrainingArtifacts.load(none)
    swapped = Path(shutil.copytree(generated.device, tmp_path / "swapped"))
    shutil.copyfile(generated.complete / f"{generated.prefix}checkpoint",
                    swapped / f"{generated.prefix}nominal_checkpoint")
    with pytest.raises(ArtifactError, match=r"nominal_checkpoint holds weights, but a nominal checkpoint holds names "
                                            r"and shapes only; rename it to (mobile_)?checkpoint"):
        TrainingArtifacts.load(swapped)


def test_inspect_lists_the_device_files_and_says_there_are_no_weights(exported: Shipped) -> None:
    shown = " ".join(describe(exported.device).split())
    for name in ("training_model.ort", "eval_model.ort", "optimizer_model.ort", "nominal_checkpoint"):
        assert f"device file: {name} (" in shown, shown
    assert "device file: checkpoint" not in shown
    assert f"parameters: {4 * 5 + 5 + 5 * 3 + 3:,} values in 4 tensors" in shown  # the Net's, counted here
    assert "weights: none in this folder (nominal_checkpoint only: names and shapes); train it with " \
           "ORTLightningModule(folder, values={name: tensor})" in shown


def test_inspect_of_the_full_export_lists_exactly_what_a_device_loads(exported: Shipped, tmp_path: Path) -> None:
    """The export folder holds .onnx and .ort graphs, both checkpoints and the operator lists; a device loads four."""
    rows = re.findall(r"^device file: +(\S+) \(", describe(exported.complete), re.MULTILINE)
    assert rows == ["training_model.ort", "eval_model.ort", "optimizer_model.ort", "nominal_checkpoint"]
    present = {path.name for path in exported.complete.iterdir()}
    assert {"checkpoint", "training_model.onnx", "training_model.required_operators.config"} <= present
    # the listed files alone start a device in ONNX Runtime's own sequence, and train
    listed = tmp_path / "listed"
    listed.mkdir()
    for name in rows:
        shutil.copyfile(exported.complete / name, listed / name)
    state = CheckpointState.load_checkpoint(str(exported.complete / "checkpoint"))
    values = {name: torch.from_numpy(np.array(parameter.data)) for name, parameter in state.parameters}
    trained = ort_device_loop(listed, _batches(2, seed=5), lr=LR, values=values)
    assert sorted(trained) == sorted(values)
    assert max(float(np.abs(trained[name] - values[name].numpy()).max()) for name in values) > 1e-3


def test_inspect_explains_the_operator_lists_of_the_ort_graphs(exported: Shipped) -> None:
    shown = " ".join(describe(exported.complete).split())
    assert ("operator lists: eval_model.required_operators.config, optimizer_model.required_operators.config, "
            "training_model.required_operators.config: the operators of each .ort graph") in shown
    assert "a device does not load them" in shown
    assert "reduced-operator ONNX Runtime build for mobile" in shown
