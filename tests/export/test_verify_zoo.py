"""Export verification both ways: correct models at default settings pass, wrong artifacts are refused.

(a) Every correct model here is exported with verification on (the default) and must pass:
CNNs with BatchNorm and ReLU (ResNet-18, EfficientNet-B0-like, MobileNetV3 blocks), torch's
transformers and Hugging Face's BERT and GPT-2 with their default dropout, a peft LoRA adapter,
an LSTM language model. (b) Artifacts made wrong on purpose (a gradient scaled by 1.01, a sign
flipped, a residual term dropped, a BatchNorm statistic off by one sample) must be refused,
naming the parameter. Each case prints its margin: the worst difference over its tolerance.
And the verification step is the training step: its gradients equal those of the first step
of a Trainer on the same inputs.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, TrainingArtifacts, export_artifacts
from ort_lightning.errors import ExportError
from ort_lightning.export.verify import job as _job
from ort_lightning.export.verify import verifier as _verify
from ort_lightning.export.verify.reference import Call, labels_for, reference_loss
from tests.helpers import GradientProbe, quiet_trainer, scale_gradient, tiered

CLASSES = 10


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18's layout (7x7 stem, max pool, 4 stages of 2 basic blocks) with torchvision's init, narrow."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, width, 7, 2)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        stages, cin = [], width
        for index, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            stride = 1 if index == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, CLASSES)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int, gate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1), gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class InvertedResidual(nn.Module):
    """MBConv (EfficientNet: SiLU, sigmoid gate) or MobileNetV3 block (Hardswish, hardsigmoid gate)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, mobilenet: bool) -> None:
        super().__init__()
        hidden, act = cin * expand, (nn.Hardswish() if mobilenet else nn.SiLU())
        gate = nn.functional.hardsigmoid if mobilenet else torch.sigmoid
        self.block = nn.Sequential(
            *_conv_bn(cin, hidden, 1), act, *_conv_bn(hidden, hidden, 3, stride, groups=hidden), act,
            SqueezeExcite(hidden, max(1, cin // 2), gate), *_conv_bn(hidden, cout, 1),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.residual else self.block(x)


class EfficientNetB0Like(nn.Module):
    """EfficientNet-B0's building blocks (stem, MBConv with SE, 1x1 head, dropout 0.2), few and narrow."""

    def __init__(self, mobilenet: bool = False) -> None:
        super().__init__()
        act = nn.Hardswish() if mobilenet else nn.SiLU()
        self.stem = nn.Sequential(*_conv_bn(3, 8, 3, 2), act)
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, 1, 1, mobilenet), InvertedResidual(8, 12, 2, 4, mobilenet),
            InvertedResidual(12, 12, 1, 4, mobilenet), InvertedResidual(12, 16, 2, 4, mobilenet),
        )
        self.head = nn.Sequential(*_conv_bn(16, 32, 1), act)
        self.dropout, self.fc = nn.Dropout(0.2), nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.head(self.blocks(self.stem(x))).mean((2, 3))))


VOCAB, SEQ, D = 20, 6, 16


class TorchTransformer(nn.Module):
    """Tokens -> nn.TransformerEncoder, nn.TransformerDecoder or nn.Transformer (default dropout 0.1) -> classes."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.embed = kind, nn.Embedding(VOCAB, D)
        if kind == "encoder":
            self.body: nn.Module = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 4, 32, batch_first=True), 2)
        elif kind == "decoder":
            self.body = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 4, 32, batch_first=True), 2)
        else:
            self.body = nn.Transformer(D, 4, 1, 1, 32, batch_first=True)
        self.fc = nn.Linear(D, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        y = self.body(x) if self.kind == "encoder" else self.body(x, x)
        return self.fc(y.mean(1))


class Attention(nn.Module):
    """A bare nn.MultiheadAttention(dropout=0.1); its dropout runs inside F.multi_head_attention_forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention = nn.Embedding(VOCAB, D), nn.MultiheadAttention(D, 2, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(D, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.fc(self.attention(x, x, x)[0].mean(1))


class LSTMLanguageModel(nn.Module):
    """Embedding -> Dropout(0.1) -> 2-layer LSTM -> next-token logits, flattened to (B*T, V).

    NOTE: nn.LSTM's own ``dropout=`` between layers cannot be exported in training mode by torch's
    exporter ("ONNX export of operator RNN/GRU/LSTM, dropout in training mode"); dropout goes on
    the embeddings instead, as in the usual word-level LM.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.drop = nn.Embedding(VOCAB, D), nn.Dropout(0.1)
        self.lstm, self.out = nn.LSTM(D, D, 2, batch_first=True), nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.drop(self.embed(tokens)))[0]).flatten(0, 1)


class HuggingFace(nn.Module):
    """A Hugging Face model's logits; a causal LM's flattened to (B*T, V) (class axis 1 for the loss)."""

    def __init__(self, model: nn.Module, flatten: bool) -> None:
        super().__init__()
        self.model, self.flatten = model, flatten

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=input_ids).logits
        return logits.flatten(0, 1) if self.flatten else logits


def _bert(labels: int = CLASSES) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=labels)
    return BertForSequenceClassification(config)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=D, n_layer=2, n_head=2))


def _lora_bert() -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    return peft.get_peft_model(_bert(), config)


def _images(batch: int) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))


def _tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(batch))


@dataclass(frozen=True)
class Correct:
    name: str
    build: Callable[[], nn.Module]
    example: Callable[[int], torch.Tensor]
    batch: int = 8
    input_names: tuple[str, ...] | None = None


CORRECT = [
    Correct("resnet18", ResNet18, _images),
    Correct("efficientnet-b0-like", EfficientNetB0Like, _images),
    Correct("mobilenetv3-blocks", lambda: EfficientNetB0Like(mobilenet=True), _images),
    Correct("multihead-attention", Attention, _tokens, 4),
    Correct("transformer-encoder", lambda: TorchTransformer("encoder"), _tokens, 4),
    Correct("transformer-decoder", lambda: TorchTransformer("decoder"), _tokens, 4),
    Correct("transformer", lambda: TorchTransformer("transformer"), _tokens, 4),
    Correct("bert", lambda: HuggingFace(_bert(), flatten=False), _tokens, 4, ("input_ids",)),
    Correct("gpt2", lambda: HuggingFace(_gpt2(), flatten=True), _tokens, 4, ("input_ids",)),
    Correct("lora-bert", lambda: HuggingFace(_lora_bert(), flatten=False), _tokens, 4, ("input_ids",)),
    Correct("lstm-lm", LSTMLanguageModel, _tokens, 4),
]


def _frozen(model: nn.Module) -> list[str]:
    # NOTE: the line a peft user writes; it names classifier.original_module.*, which the forward never reads.
    return [name for name, parameter in model.named_parameters() if not parameter.requires_grad]


#: What the fast tier verifies (a few seconds each); the full run verifies every model.
FAST_VERIFIED = {"multihead-attention", "transformer-decoder", "lstm-lm"}
#: What the fast tier trains; the others take seconds each.
FAST_TRAINED = {"efficientnet-b0-like", "multihead-attention", "transformer-encoder", "lora-bert", "lstm-lm"}


@pytest.mark.parametrize("case", tiered(CORRECT, ids=[case.name for case in CORRECT], fast=FAST_VERIFIED))
def test_a_correct_model_at_default_settings_is_verified(tmp_path: Path, case: Correct) -> None:
    torch.manual_seed(0)
    model = case.build()
    names = list(case.input_names) if case.input_names else None
    artifacts = export_artifacts(model, case.example(case.batch), tmp_path / case.name, input_names=names,
                                 frozen=_frozen(model))
    report = artifacts.manifest.verification
    assert report is not None
    assert report["status"] == "passed"
    for check in report["batches"]:
        print(f"{case.name} batch {check['batch_size']}: margin {check['tolerance_used']:.3f} "
              f"({check['worst_parameter']}, diff {check['grad_abs_diff']:.2g}, allowed {check['grad_tolerance']:.2g}, "
              f"ambiguous ReLUs {check['ambiguous_relus']})")
        assert check["tolerance_used"] <= 1.0


class ResidualBNNet(nn.Module):
    """stem conv -> BatchNorm -> ReLU -> residual block -> head: room for every wrong artifact below."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.block = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        x = x + torch.tanh(self.block(x))
        return self.fc(x.mean((2, 3)))


def _flip_sign(path: Path) -> str:
    scale_gradient(path, "fc.weight", -1.0)
    return "fc.weight"


def _scaled(path: Path) -> str:
    scale_gradient(path, "block.weight", 1.01)
    return "block.weight"


def _drop_residual(path: Path) -> str:
    """The gradient that reaches the residual's input through the skip term is dropped (only the branch's remains)."""
    proto = onnx.load(path)
    node = next(n for n in proto.graph.node if n.op_type == "Sum" and n.name.startswith("AccumulateGrad_"))
    node.op_type, node.name = "Identity", node.name + "_dropped"
    kept = [name for name in node.input if "Add_Grad" not in name][:1] or list(node.input[:1])
    del node.input[:]
    node.input.extend(kept)
    onnx.save(proto, path)
    return r"(stem|bn)\."


def _batchnorm_off_by_one(path: Path) -> str:
    """The BatchNorm gradient normalizes with n - 1 samples' variance instead of n's (its inverse std scaled)."""
    proto = onnx.load(path)
    node = next(n for n in proto.graph.node if n.op_type == "BatchNormalizationGrad")
    n = 8 * 8 * 8  # batch 8, 8x8 images
    factor = numpy_helper.from_array(np.array(np.sqrt(n / (n - 1)), dtype=np.float32), "off_by_one")
    proto.graph.initializer.append(factor)
    scaled = node.input[4] + "_off_by_one"
    index = list(proto.graph.node).index(node)
    proto.graph.node.insert(index, helper.make_node("Mul", [node.input[4], "off_by_one"], [scaled]))
    node.input[4] = scaled
    onnx.save(proto, path)
    return r"(stem|bn)\."


WRONG: dict[str, Callable[[Path], str]] = {
    "gradient-scaled-by-1.01": _scaled,
    "sign-flipped": _flip_sign,
    "residual-term-dropped": _drop_residual,
    "batchnorm-statistic-off-by-one-sample": _batchnorm_off_by_one,
}


@pytest.mark.parametrize(
    "tamper", tiered(list(WRONG), ids=list(WRONG), fast={"gradient-scaled-by-1.01", "sign-flipped"})
)
def test_a_wrong_artifact_is_refused_naming_the_parameter(tmp_path: Path, tamper: str) -> None:
    torch.manual_seed(0)
    model, example = ResidualBNNet(), torch.randn(8, 3, 8, 8)
    pristine = copy.deepcopy(model)
    artifacts = export_artifacts(model, example, tmp_path / tamper, verify=False)
    expected = WRONG[tamper](artifacts.training_model)
    with pytest.raises(ExportError) as refused:
        _verify.verify_export(artifacts.manifest, artifacts.directory, model=pristine, example_inputs=example,
                              loss="cross_entropy")
    message = str(refused.value)
    named = re.search(r"gradient of '([^']+)' differs .*?, ([0-9.e+]+) times what float32", message)
    assert named is not None, message
    print(f"{tamper}: refused, {named.group(1)} at margin {float(named.group(2)):.3g}")
    assert re.match(expected, named.group(1)), message


def _trainer_gradients(artifacts: TrainingArtifacts, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    tensors = [torch.from_numpy(arrays[f"i{index}"]) for index in range(len(arrays))]
    loader = DataLoader(TensorDataset(*tensors), batch_size=len(tensors[0]), shuffle=False)
    probe = GradientProbe()
    trainer = quiet_trainer(max_steps=1, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(ORTLightningModule(artifacts, lr=1e-3), loader)
    return probe.grads


@pytest.mark.slow
def test_the_verification_step_is_the_training_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, example = ResNet18(width=4), _images(8)
    artifacts = export_artifacts(model, example, tmp_path / "resnet", verify=False)
    job = tmp_path / "job"
    job.mkdir()
    batches = [8, 9]
    for batch in batches:
        _verify.prepare_batch(job, artifacts.directory, artifacts.manifest, batch, model=model, examples=[example],
                              call=Call(), loss_fn=reference_loss("cross_entropy"))
    _job.write_job(job, artifacts.directory, artifacts.manifest, batches)
    _job.run_child(job, artifacts.directory, batches)
    for batch in batches:
        with np.load(job / f"inputs_{batch}.npz") as arrays:
            trained = _trainer_gradients(artifacts, dict(arrays))
        with _job.read_result(job, batch) as (_, child):  # the child's gradients, read from disk one by one
            assert set(trained) == set(child) == set(artifacts.manifest.trainable)
            for name, grad in trained.items():
                assert torch.equal(grad, torch.from_numpy(child[name])), (batch, name)
    assert json.loads((job / "job.json").read_text())["batches"] == batches


@pytest.mark.parametrize("case", tiered(CORRECT, ids=[case.name for case in CORRECT], fast=FAST_TRAINED))
def test_a_correct_model_trains_under_a_trainer(tmp_path: Path, case: Correct) -> None:
    """Each zoo model's artifacts train: two AdamW steps move the weights and keep the loss finite."""
    torch.manual_seed(0)
    model = case.build()
    names = list(case.input_names) if case.input_names else None
    example = case.example(case.batch)
    artifacts = export_artifacts(model, example, tmp_path / case.name, input_names=names, frozen=_frozen(model),
                                 verify=False)
    module = ORTLightningModule(artifacts, lr=1e-3, lr_scheduler="constant")
    output = module(example)
    output = output[0] if isinstance(output, tuple) else output
    labels = labels_for(artifacts.manifest.labels, tuple(output.shape), case.batch, seed=0)
    before = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    losses: list[float] = []

    class _Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *_: Any) -> None:
            losses.append(float(outputs["loss"]))

    trainer = quiet_trainer(max_steps=2, callbacks=[_Losses()])
    trainer.fit(module, DataLoader([(example, *labels)], batch_size=None))
    assert len(losses) == 2
    assert all(np.isfinite(losses))
    assert any(not torch.equal(before[name], p) for name, p in module.named_parameters() if name in before)
