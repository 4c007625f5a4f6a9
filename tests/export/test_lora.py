"""peft LoRA on the Llama-family decoders: export, train under a Trainer, match torch + peft.

Each family of `tests.decoders` (transformers' default attention) gets ``get_peft_model(model,
LoraConfig(target_modules="all-linear"))``: every attention and MLP projection. It is exported on its
own loss from a packed causal-LM batch (``input_ids`` and ``labels``, no mask) without verification
(the test compares with torch itself) and trains 10 AdamW steps at lr 1e-3 under a real Trainer. The
reference is torch + peft with ``torch.optim.AdamW`` on the same batch (`tests.step_reference`): the
step-1 gradients within 1e-3 relative for every family, and, for a few families and every peft variant,
the adapters after 10 steps within 1e-4 absolute or 3x torch's own float32 noise. peft initialises
``lora_B`` to zero, which makes the step-1 gradient of ``lora_A`` zero, so the adapters start random
(``init_lora_weights=False``). The frozen base must come out of training byte-identical, and the only
trainable parameters are the adapters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.errors import ExportError
from tests.decoders import FAMILIES, decoder, token_batch
from tests.helpers import tiered
from tests.step_reference import (
    AdamWReference,
    assert_gradients_close,
    assert_parameters_close,
    ort_steps,
    torch_adamw_steps,
    torch_step,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, LR = 10, 1e-3
#: What the fast tier trains: the family every other copies (with two adapters, below); the full run trains all.
FAST_FAMILIES = {"llama"}
#: Whose adapters are compared with torch's after the 10 steps (torch's side is most of a test's time): Llama,
#: Gemma (the tanh GELU after a LoRA output) and GPT-NeoX (fused QKV); every family is compared at step 1.
STEPPED_FAMILIES = {"llama", "gemma", "gpt-neox"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _packed(seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed causal-LM batch: token ids and labels equal to them (the model shifts), no attention mask."""
    batch = token_batch(seed=seed)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def _lora(base: torch.nn.Module, **options: Any) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **options)
    return peft.get_peft_model(base, config)


def _model(family: str, **options: Any) -> torch.nn.Module:
    return _lora(decoder(family), **options)


def _assert_trains_like_torch(model: torch.nn.Module, folder: Path, *, compare_steps: bool) -> ORTLightningModule:
    """Export `model`, train it `STEPS` steps under a Trainer, and check it against torch + peft: only the
    adapters train, the step-1 loss and gradients, the base byte-identical after the steps, and with
    `compare_steps` the adapters after them against torch's AdamW (20 torch steps, float32 and float64)."""
    batch = _packed()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapters = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    loss, reference_grads = torch_step(copy.deepcopy(model), lambda m: m(**batch).loss)
    artifacts = export_artifacts(copy.deepcopy(model), batch, folder, loss=None, verify=False)
    losses, grads, module = ort_steps(artifacts, batch, steps=STEPS, lr=LR)
    trained = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    assert sorted(trained) == adapters  # the adapters, and nothing else, train
    assert losses[0] == pytest.approx(loss, rel=1e-5)
    assert assert_gradients_close(grads, reference_grads, rtol=1e-3, atol=1e-6) < 1e-3
    assert all(not torch.equal(trained[name], original[name]) for name in adapters)
    if compare_steps:
        reference = torch_adamw_steps(model, lambda m: m(**batch).loss, steps=STEPS, lr=LR)
        assert_parameters_close(trained, AdamWReference({name: reference.parameters[name] for name in adapters},
                                                        reference.noise_floor), atol=1e-4)
    frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
    assert frozen, "the base is in the ORT state as frozen parameters"
    for name, value in frozen.items():
        assert torch.equal(value, original[name]), f"frozen {name} changed"
    return module


@pytest.mark.parametrize("family", tiered(FAMILIES, ids=FAMILIES, fast=FAST_FAMILIES))
def test_lora_on_attention_and_mlp_trains_as_torch_and_peft(family: str, tmp_path: Path) -> None:
    model = _model(family)
    module = _assert_trains_like_torch(model, tmp_path, compare_steps=family in STEPPED_FAMILIES)
    frozen = sorted(name for name, p in module.named_parameters() if not p.requires_grad)
    assert frozen == sorted(name for name, p in model.named_parameters() if not p.requires_grad)


def _two_adapters() -> torch.nn.Module:
    model = _model("llama")
    torch.manual_seed(2)
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                init_lora_weights=False))
    model.set_adapter("second")
    return model


VARIANTS: dict[str, Callable[[], torch.nn.Module]] = {
    "modules-to-save": lambda: _model("llama", modules_to_save=["lm_head", "embed_tokens"]),
    "rslora": lambda: _model("llama", use_rslora=True),
    "two-adapters": _two_adapters,
}


@pytest.mark.parametrize("variant", tiered(list(VARIANTS), ids=list(VARIANTS), fast={"two-adapters"}))
def test_peft_variants_train_as_torch_and_peft(variant: str, tmp_path: Path) -> None:
    model = VARIANTS[variant]()
    module = _assert_trains_like_torch(model, tmp_path, compare_steps=True)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    in_ort = {name for name, _ in module.named_parameters()}
    if variant == "modules-to-save":
        assert {"base_model.model.lm_head.modules_to_save.default.weight",
                "base_model.model.model.embed_tokens.modules_to_save.default.weight"} <= trainable
        # NOTE: peft keeps each replaced module beside its trained copy; the forward never reads it.
        assert not {name for name in in_ort if ".original_module." in name}
    if variant == "rslora":
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        assert layer.scaling["default"] == pytest.approx(8 / 4**0.5)  # alpha / sqrt(r), not alpha / r
    if variant == "two-adapters":
        assert trainable
        assert all(".second." in name for name in trainable)
        inactive = {name for name, _ in model.named_parameters() if ".default." in name}
        assert inactive
        # NOTE: the forward never reads the inactive adapter: it is not in the ORT state, so nothing can train it.
        assert not inactive & in_ort


def test_dora_is_refused_at_export_with_the_reason(tmp_path: Path) -> None:
    model = _model("llama", use_dora=True)
    message = (r"peft's DoRA \(LoraConfig\(use_dora=True\)\) is active in "
               r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj' and 13 more, .* torch's ONNX exporter "
               r"drops the detach.* Use LoRA \(use_dora=False")
    with pytest.raises(ExportError, match=message):
        export_artifacts(model, _packed(0), tmp_path, loss=None, verify=False)
    assert not (tmp_path / "training_model.onnx").exists()


def _moments(path: Path) -> dict[str, list[tuple[int, ...]]]:
    """The optimizer state of an ORT checkpoint file: parameter name -> the shapes of its moments."""
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs.Checkpoint import Checkpoint

    checkpoint = Checkpoint.GetRootAs(path.read_bytes(), 0)
    moments: dict[str, list[tuple[int, ...]]] = {}
    for group in (checkpoint.OptimizerGroups(g) for g in range(checkpoint.OptimizerGroupsLength())):
        for state in (group.OptimizerStates(s) for s in range(group.OptimizerStatesLength())):
            moments[state.ParamName().decode()] = [tuple(int(d) for d in state.Momentums(m).DimsAsNumpy())
                                                   for m in range(state.MomentumsLength())]
    return moments


@pytest.mark.parametrize("tuning", tiered(["lora", "full"], ids=["lora", "full"], fast={"lora"}))
def test_the_optimizer_state_holds_moments_for_the_trainable_parameters_only(tuning: str, tmp_path: Path) -> None:
    model = _model("llama") if tuning == "lora" else decoder("llama")
    artifacts = export_artifacts(model, _packed(99), tmp_path / "artifacts", loss=None, verify=False)
    _, _, module = ort_steps(artifacts, _packed(0), steps=1, lr=LR)
    trainable = {name: tuple(p.shape) for name, p in module.named_parameters() if p.requires_grad}
    values = sum(p.numel() for p in module.parameters())
    with_state = module.save_ort_checkpoint(tmp_path / "with.ckpt", include_optimizer_state=True)
    without = module.save_ort_checkpoint(tmp_path / "without.ckpt", include_optimizer_state=False)
    moments = _moments(with_state)
    assert sorted(moments) == sorted(trainable)  # AdamW's two moments, for each trainable parameter and no other
    for name, shapes in moments.items():
        assert shapes == [trainable[name]] * 2, name
    assert _moments(without) == {}
    moment_bytes = 2 * 4 * sum(torch.Size(shape).numel() for shape in trainable.values())
    extra = with_state.stat().st_size - without.stat().st_size
    assert moment_bytes <= extra <= moment_bytes + 256 * 2 * len(trainable) + 4096  # names and dims beside the data
    print(f"\n{tuning}: {values:,} values, {sum(torch.Size(s).numel() for s in trainable.values()):,} trainable in "
          f"{len(trainable)} tensors; checkpoint {without.stat().st_size:,} B without the optimizer state, "
          f"{with_state.stat().st_size:,} B with it (+{extra:,} B; the moments hold {moment_bytes:,} B)")
