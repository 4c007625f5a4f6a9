"""Torch loss modules as `export_artifacts(loss=...)`: step-1 loss and gradients equal torch's own module.

The exports skip verification (``verify=False``): each test compares the gradients with torch itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.errors import BatchError, ExportError
from tests.step_reference import assert_gradients_close, ort_steps, torch_step, trainer

CLASSES = 3


def _features(seed: int = 0, n: int = 16) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))


def _classes(n: int = 16, *, ignored: int | None = None) -> torch.Tensor:
    labels = torch.arange(n) % CLASSES
    if ignored is not None:
        labels[::5] = ignored
    return labels


def _targets(scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(16, CLASSES, generator=torch.Generator().manual_seed(1))


def _probabilities() -> torch.Tensor:
    return torch.rand(16, CLASSES, generator=torch.Generator().manual_seed(2))


class LogSoftmaxNet(nn.Module):
    """Linear -> LogSoftmax, the model NLLLoss expects."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(x), dim=1)


WEIGHT = torch.tensor([0.5, 2.0, 1.5])
# id -> (torch loss module, model factory, labels)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "cross-entropy": (nn.CrossEntropyLoss, lambda: nn.Linear(4, CLASSES), _classes),
    "cross-entropy-weight-ignore-sum": (
        lambda: nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=-100, reduction="sum"),
        lambda: nn.Linear(4, CLASSES), lambda: _classes(ignored=-100)),
    "cross-entropy-weight-mean-ignore-1": (
        lambda: nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=1), lambda: nn.Linear(4, CLASSES), _classes),
    "cross-entropy-label-smoothing": (
        lambda: nn.CrossEntropyLoss(label_smoothing=0.1), lambda: nn.Linear(4, CLASSES),
        lambda: _classes(ignored=-100)),
    "cross-entropy-label-smoothing-weight": (
        lambda: nn.CrossEntropyLoss(label_smoothing=0.2, weight=WEIGHT), lambda: nn.Linear(4, CLASSES),
        lambda: _classes(ignored=-100)),
    "nll": (nn.NLLLoss, LogSoftmaxNet, _classes),
    "nll-weight-ignore-sum": (
        lambda: nn.NLLLoss(weight=WEIGHT, ignore_index=-100, reduction="sum"), LogSoftmaxNet,
        lambda: _classes(ignored=-100)),
    "nll-weight-mean": (lambda: nn.NLLLoss(weight=WEIGHT), LogSoftmaxNet, _classes),
    "mse": (nn.MSELoss, lambda: nn.Linear(4, CLASSES), _targets),
    "mse-sum": (lambda: nn.MSELoss(reduction="sum"), lambda: nn.Linear(4, CLASSES), _targets),
    "l1": (nn.L1Loss, lambda: nn.Linear(4, CLASSES), _targets),
    "bce-with-logits": (nn.BCEWithLogitsLoss, lambda: nn.Linear(4, CLASSES), _probabilities),
    "bce-with-logits-pos-weight-weight": (
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 3.0, 0.5]), weight=torch.tensor([2.0, 1.0, 1.0])),
        lambda: nn.Linear(4, CLASSES), _probabilities),
    "smooth-l1": (lambda: nn.SmoothL1Loss(beta=0.5), lambda: nn.Linear(4, CLASSES), _targets),
    "smooth-l1-beta-0": (lambda: nn.SmoothL1Loss(beta=0.0), lambda: nn.Linear(4, CLASSES), _targets),
    "huber": (lambda: nn.HuberLoss(delta=0.4, reduction="sum"), lambda: nn.Linear(4, CLASSES), _targets),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_torch_loss_module_matches_torch(case: str, tmp_path: Path) -> None:
    make_loss, make_model, make_labels = CASES[case]
    torch.manual_seed(0)
    model, loss_fn, x, labels = make_model(), make_loss(), _features(), make_labels()
    artifacts = export_artifacts(model, torch.zeros(2, 4), tmp_path, loss=loss_fn, optimizer="sgd", verify=False)
    losses, grads, _ = ort_steps(artifacts, (x, labels))
    expected, reference = torch_step(model, lambda m: loss_fn(m(x), labels))
    assert losses[0] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert_gradients_close(grads, reference, rtol=1e-5, atol=1e-6)


def test_a_loss_name_means_torchs_default_module(tmp_path: Path) -> None:
    # "cross_entropy" is nn.CrossEntropyLoss(): -100 labels are ignored, as in torch.
    torch.manual_seed(0)
    model, x, labels = nn.Linear(4, CLASSES), _features(), _classes(ignored=-100)
    artifacts = export_artifacts(model, torch.zeros(2, 4), tmp_path, loss="cross_entropy", verify=False)
    assert artifacts.manifest.loss_options == {"reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0}
    losses, grads, _ = ort_steps(artifacts, (x, labels))
    expected, reference = torch_step(model, lambda m: nn.functional.cross_entropy(m(x), labels))
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert_gradients_close(grads, reference, rtol=1e-5, atol=1e-6)


class SegmentationNet(nn.Module):
    """Conv1d over (B, 4, L): per-position class scores (B, C, L), torch's class axis 1."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, CLASSES, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_cross_entropy_on_rank_3_logits_takes_the_class_axis_1(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, loss_fn = SegmentationNet(), nn.CrossEntropyLoss(ignore_index=-100)
    x = torch.randn(4, 4, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, CLASSES, (4, 5), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = -100
    artifacts = export_artifacts(model, torch.zeros(2, 4, 5), tmp_path, loss=loss_fn, optimizer="sgd", verify=False)
    assert artifacts.manifest.labels[0].shape == ("batch", 5)
    losses, grads, _ = ort_steps(artifacts, (x, labels))
    expected, reference = torch_step(model, lambda m: loss_fn(m(x), labels))
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert_gradients_close(grads, reference, rtol=1e-5, atol=1e-6)


class TinyLM(nn.Module):
    """Embedding -> Linear: (B, T) token ids to (B, T, V) logits, or flattened to (B*T, V)."""

    def __init__(self, vocab: int = 11, *, flatten: bool = False) -> None:
        super().__init__()
        self.flatten = flatten
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return logits.view(-1, logits.shape[-1]) if self.flatten else logits


def test_language_model_logits_are_refused_with_the_flattening_recipe(tmp_path: Path) -> None:
    message = (r"Output 'logits' has shape \['batch', 6, 11\], like a language model's \(B, T, V\) logits over "
               r"input 'input' \['batch', 6\].*class axis 1.*logits\.view\(-1, 11\).*labels\.view\(-1\)")
    with pytest.raises(ExportError, match=message):
        export_artifacts(TinyLM(), torch.zeros(2, 6, dtype=torch.long), tmp_path, loss=nn.CrossEntropyLoss())


def test_flattened_language_model_trains_like_torch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, loss_fn = TinyLM(flatten=True), nn.CrossEntropyLoss()
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    artifacts = export_artifacts(
        model, torch.zeros(2, 6, dtype=torch.long), tmp_path, loss=loss_fn, optimizer="sgd", verify=False
    )
    # The flattened rows get their own symbol, B*T: labels for forward() are sized from it.
    assert artifacts.manifest.labels[0].shape == ("batch*6",)
    losses, grads, module = ort_steps(artifacts, (ids, labels.view(-1)))
    expected, reference = torch_step(model, lambda m: loss_fn(m(ids), labels.view(-1)))
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert_gradients_close(grads, reference, rtol=1e-5, atol=1e-6)
    model.load_state_dict({name: p.detach() for name, p in module.named_parameters()})
    three = ids[:3]
    torch.testing.assert_close(module(three), model(three).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (nn.CrossEntropyLoss(reduction="none"),
         r"CrossEntropyLoss\(reduction='none'\) gives one loss per element.*use reduction='mean' or 'sum'"),
        (nn.MSELoss(reduction="none"), r"MSELoss\(reduction='none'\).*loss=None"),
        (nn.KLDivLoss(),
         r"Expected `loss` to be one of .*nn\.CrossEntropyLoss.*but got KLDivLoss\(\).*onnxblock\.Block"),
        ("hinge", r"Expected `loss` to be one of \['cross_entropy', 'mse'.*but got 'hinge'"),
    ],
    ids=["reduction-none", "mse-reduction-none", "unsupported-module", "unknown-name"],
)
def test_losses_torch_cannot_express_here_are_refused(loss: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=message):
        export_artifacts(nn.Linear(4, CLASSES), torch.zeros(2, 4), tmp_path, loss=loss)


def test_cross_entropy_needs_a_class_axis(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"cross_entropy needs logits of shape \(B, C\).*has shape \['batch'\]"):
        export_artifacts(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)), torch.zeros(2, 4), tmp_path)


def test_loss_options_reach_the_manifest_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ort_lightning.cli import main

    loss = nn.CrossEntropyLoss(weight=WEIGHT, ignore_index=-1, reduction="sum")
    artifacts = export_artifacts(nn.Linear(4, CLASSES), torch.zeros(2, 4), tmp_path / "a", loss=loss, verify=False)
    options = artifacts.manifest.loss_options
    assert options["ignore_index"] == -1
    assert options["reduction"] == "sum"
    assert options["weight"] == pytest.approx([0.5, 2.0, 1.5])
    main(["inspect", str(tmp_path / "a")])
    shown = capsys.readouterr().out
    # NOTE: inspect aligns its values on the longest key, which depends on the rows a folder has.
    loss_row = "cross_entropy reduction=sum weight=[0.5, 2.0, 1.5] ignore_index=-1 label_smoothing=0.0"
    assert re.search(rf"^loss: +{re.escape(loss_row)}$", shown, re.M)


def test_label_range_accepts_ignore_index_and_still_refuses_other_values(tmp_path: Path) -> None:
    loss = nn.CrossEntropyLoss(ignore_index=-7)
    artifacts = export_artifacts(nn.Linear(4, CLASSES), torch.zeros(2, 4), tmp_path, loss=loss, verify=False)
    x = _features()
    ort_steps(artifacts, (x, _classes(ignored=-7)))  # trains: -7 is ignored
    labels = _classes(ignored=-7)
    labels[1] = -1
    module = ORTLightningModule(artifacts)
    message = r"must be class indices in \[0, 3\) besides ignore_index=-7, but the batch has values in \[-1, 2\]"
    with pytest.raises(BatchError, match=message):
        trainer(1, []).fit(module, torch.utils.data.DataLoader([(x, labels)], batch_size=None))


def test_a_model_older_than_opset_13_is_refused_with_the_fix(tmp_path: Path) -> None:
    import onnx

    path = tmp_path / "old.onnx"
    torch.onnx.export(nn.Linear(4, CLASSES), (torch.zeros(2, 4),), path, dynamo=False, opset_version=12,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    assert onnx.load(path).opset_import[0].version == 12
    with pytest.raises(ExportError, match=r"loss='nll' is built with ai.onnx opset 13 operators, but the model uses "
                                          r"opset 12; re-export it with opset_version >= 13"):
        export_artifacts(path, output_dir=tmp_path / "a", loss="nll")
