"""peft LoRA on the Llama-family decoders: export, train under a Trainer, match torch + peft.

Each family of transformers' decoders gets ``get_peft_model(model, LoraConfig(target_modules="all-linear"))``
(every attention and MLP projection), is exported on its own loss without verification (the test
compares with torch itself) and trains 10 AdamW steps at lr 1e-3 under a real Trainer on 10
batches. The reference is torch + peft with ``torch.optim.AdamW`` on the same batches: the step-1
gradients within 1e-3 relative, the adapters after 10 steps within 1e-4 absolute or 3x torch's own
noise floor (float32 torch against float64 torch: a weight whose gradient is ~0 gets AdamW steps of
the rate's size in any float32 run). peft initialises ``lora_B`` to zero, which makes the step-1
gradient of ``lora_A`` zero, so the adapters start random (``init_lora_weights=False``). The frozen
base must come out of training byte-identical, and the only trainable parameters are the adapters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.errors import ExportError
from tests.helpers import GradientProbe, quiet_trainer, tiered
from tests.step_reference import assert_gradients_close

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, BATCH, SEQ, STEPS, LR = 100, 4, 8, 10, 1e-3
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)


def _gqa(config: str, model: str, **options: Any) -> Callable[[], torch.nn.Module]:
    """A tiny decoder with 4 query and 2 key/value heads, at transformers' default attention."""
    return lambda: getattr(transformers, model)(getattr(transformers, config)(num_key_value_heads=2, **_COMMON,
                                                                              **options))


#: family -> a tiny random model of it (2 layers, hidden 64, vocabulary 100).
FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _gqa("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _gqa("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _gqa("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),
    "mistral": _gqa("MistralConfig", "MistralForCausalLM", sliding_window=None),
    "mistral-sliding-window": _gqa("MistralConfig", "MistralForCausalLM", sliding_window=4),
    "phi3": _gqa("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "gemma": _gqa("GemmaConfig", "GemmaForCausalLM", head_dim=16),
    "gemma2": _gqa("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, sliding_window=4),
    "olmo2": _gqa("Olmo2Config", "Olmo2ForCausalLM"),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**_COMMON)),
}
#: What the fast tier trains: the family every other copies, and Gemma (its tanh GELU after a LoRA output).
FAST_FAMILIES = {"llama", "gemma"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.utils.logging.set_verbosity_error()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """A packed causal-LM batch: token ids, labels equal to them (the model shifts), an all-ones mask.

    NOTE: the mask makes transformers pass SDPA a mask tensor instead of ``enable_gqa=True``, which
    torch's ONNX exporter cannot convert (DESIGN fact 44).
    """
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _lora(base: torch.nn.Module, **options: Any) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, **options)
    return peft.get_peft_model(base, config)


def _model(family: str, **options: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return _lora(FAMILIES[family](), **options)


@dataclass(frozen=True)
class Run:
    """One training run: the step-1 gradients and the trainable values after `STEPS` steps, by name."""

    grads: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]


def _torch_run(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], *, double: bool = False) -> Run:
    """torch + peft with ``torch.optim.AdamW`` (its defaults, as the export's) on `batches`."""
    model = copy.deepcopy(model).double() if double else copy.deepcopy(model)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    grads: dict[str, torch.Tensor] = {}
    for batch in batches:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        grads = grads or {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    values = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return Run(grads, values)


def _ort_run(module: ORTLightningModule, batches: list[dict[str, torch.Tensor]]) -> Run:
    probe = GradientProbe()
    quiet_trainer(max_steps=len(batches), num_sanity_val_steps=0, callbacks=[probe]).fit(
        module, DataLoader(batches, batch_size=None))
    return Run(probe.grads, {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad})


def _assert_trains_like_torch(model: torch.nn.Module, folder: Path) -> ORTLightningModule:
    """Export `model`, train it under a Trainer, and check it against torch + peft (see the module docstring)."""
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    adapters = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    batches = [_batch(seed) for seed in range(STEPS)]
    reference, noise = _torch_run(model, batches), _torch_run(model, batches, double=True)
    artifacts = export_artifacts(copy.deepcopy(model), _batch(99), folder, loss=None, verify=False)
    module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")
    trained = _ort_run(module, batches)
    assert sorted(trained.values) == adapters  # the adapters, and nothing else, train
    worst = assert_gradients_close(trained.grads, reference.grads, rtol=1e-3, atol=1e-6)
    assert worst < 1e-3
    for name in adapters:
        floor = float((reference.values[name] - noise.values[name]).abs().max())
        difference = float((trained.values[name] - reference.values[name]).abs().max())
        assert difference <= max(1e-4, 3 * floor), (name, difference, floor)
        assert not torch.equal(trained.values[name], original[name]), f"{name} did not train"
    frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
    assert frozen, "the base is in the ORT state as frozen parameters"
    for name, value in frozen.items():
        assert torch.equal(value, original[name]), f"frozen {name} changed"
    return module


@pytest.mark.parametrize("family", tiered(list(FAMILIES), ids=list(FAMILIES), fast=FAST_FAMILIES))
def test_lora_on_attention_and_mlp_trains_as_torch_and_peft(family: str, tmp_path: Path) -> None:
    model = _model(family)
    module = _assert_trains_like_torch(model, tmp_path)
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
    "modules-to-save": lambda: _model("llama", modules_to_save=["lm_head"]),
    "rslora": lambda: _model("llama", use_rslora=True),
    "two-adapters": _two_adapters,
}


@pytest.mark.parametrize("variant", tiered(list(VARIANTS), ids=list(VARIANTS), fast={"two-adapters"}))
def test_peft_variants_train_as_torch_and_peft(variant: str, tmp_path: Path) -> None:
    model = VARIANTS[variant]()
    module = _assert_trains_like_torch(model, tmp_path)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    in_ort = {name for name, _ in module.named_parameters()}
    if variant == "modules-to-save":
        assert "base_model.model.lm_head.modules_to_save.default.weight" in trainable
        # NOTE: peft keeps the replaced head beside its trained copy; the forward never reads it.
        assert "base_model.model.lm_head.original_module.weight" not in in_ort
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
        export_artifacts(model, _batch(0), tmp_path, loss=None, verify=False)
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
    torch.manual_seed(0)
    model = _model("llama") if tuning == "lora" else FAMILIES["llama"]()
    artifacts = export_artifacts(model, _batch(99), tmp_path / "artifacts", loss=None, verify=False)
    module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")
    _ort_run(module, [_batch(0)])
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
