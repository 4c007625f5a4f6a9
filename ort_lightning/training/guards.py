"""Guards of `ORTLightningModule` against set-ups that ONNX Runtime would train on silently, checked once per fit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ort_lightning.artifacts.checks import read_graph
from ort_lightning.bridge import LabelRange
from ort_lightning.errors import ConfigurationError

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = [
    "SUPPORTED_PRECISION",
    "check_can_train",
    "check_precision",
    "check_model_outputs",
    "check_torch_parameters",
    "label_range_of",
    "precision_supported",
    "updated_parameters",
]

#: The one Trainer precision that trains ORT graphs: they run in float32.
SUPPORTED_PRECISION = "32-true"
#: How a config or a Trainer may spell it (unset means Lightning's default, which is it).
_PRECISION_SPELLINGS = (None, 32, "32", SUPPORTED_PRECISION)


def precision_supported(precision: Any) -> bool:
    """Tell whether a Trainer precision trains ORT graphs: ``"32-true"``, however it is spelled.

    Example::

        >>> precision_supported("32-true"), precision_supported(32), precision_supported("bf16-mixed")
        (True, True, False)
    """
    return precision in _PRECISION_SPELLINGS

def label_range_of(artifacts: TrainingArtifacts) -> LabelRange | None:
    """The label check for cross-entropy/NLL artifacts whose logits have a fixed class axis; None otherwise."""
    manifest = artifacts.manifest
    if manifest.loss not in ("cross_entropy", "nll") or not manifest.labels or not manifest.outputs:
        return None
    if artifacts.eval_model.suffix != ".onnx":  # an .ort graph: ONNX Runtime's format, not onnx's
        return None
    # NOTE: the facts the folder check read (read_graph keeps them): the eval graph is read once per process.
    facts = read_graph(artifacts.eval_model)
    dims = dict(zip(facts.outputs, facts.output_dims, strict=True)).get(manifest.outputs[0])
    if dims is None:
        return None
    classes = dims[1] if len(dims) >= 2 else 0
    if classes <= 0:
        return None
    ignore_index = manifest.loss_options.get("ignore_index")
    return LabelRange(manifest.labels[0].name, index=len(manifest.inputs), classes=classes, ignore_index=ignore_index,
                      reduction=manifest.loss_options.get("reduction", "mean"))


def check_precision(precision: Any) -> None:
    """Refuse a Trainer precision other than ``"32-true"`` (`ConfigurationError`)."""
    if not precision_supported(str(precision)):
        raise ConfigurationError(
            f"ORT training graphs run in float32, but the Trainer has precision={str(precision)!r}; "
            f"use Trainer(precision={SUPPORTED_PRECISION!r})."
        )


def check_can_train(artifacts: TrainingArtifacts) -> None:
    """Refuse to fit artifacts without an optimizer graph (`ConfigurationError` naming the two ways to train)."""
    if artifacts.optimizer_model is None:
        raise ConfigurationError(
            f"{artifacts.directory} has no optimizer graph (generated with optimizer=None), so it can validate, "
            "test and predict but not fit; regenerate it with an optimizer, or pass "
            "ORTLightningModule(folder, optimizer=lambda params: torch.optim.SGD(params, lr=...))."
        )


def check_model_outputs(artifacts: TrainingArtifacts, fetched: int) -> None:
    """Refuse ``forward``/``predict`` on an eval graph whose only output is the loss (`ConfigurationError`)."""
    if fetched < 2:
        raise ConfigurationError(
            f"{artifacts.eval_model.name} outputs the loss only, so forward() and predict have no model output to "
            "return; generate the artifacts with generate_artifacts(..., additional_output_names=['<model output>']) "
            "(export_artifacts() keeps them), or run validate/test for the loss."
        )


def check_torch_parameters(module: torch.nn.Module, updated: Iterable[torch.Tensor]) -> None:
    """Refuse parameters of `module` that require grad but no optimizer updates (ORT gives them no gradient).

    Raises:
        ConfigurationError: naming those parameters, with how to freeze them or train them in ORT.
    """
    kept = {id(tensor) for tensor in updated}
    idle = [name for name, tensor in module.named_parameters() if tensor.requires_grad and id(tensor) not in kept]
    if idle:
        owners = sorted({name.rpartition(".")[0] or name for name in idle})
        raise ConfigurationError(
            f"Torch parameters {idle} require grad, but no optimizer updates them: ONNX Runtime trains only the "
            "parameters inside the exported graph and gives no gradients for its inputs, so a torch part in front "
            f"of it cannot learn from the graph's loss; freeze it (self.{owners[0]}.requires_grad_(False)), or put "
            "that part inside the model you pass to export_artifacts so that ORT trains it."
        )


def updated_parameters(optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """Every parameter in the ``param_groups`` of `optimizers`."""
    return [parameter for optimizer in optimizers for group in optimizer.param_groups for parameter in group["params"]]
