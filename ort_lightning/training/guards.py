"""Guards of `ORTLightningModule` against set-ups that ONNX Runtime would train on silently.

Checked once, not per step (the per-batch checks live where batches go: the label range in
`ort_lightning.bridge.LabelRange`, the NaN/inf loss decision in `ort_lightning.training.session.step`):

- `label_range_of`: the cross-entropy/NLL label check of an artifacts folder, when its logits
  have a fixed class axis (ORT 1.19.2 trains on labels outside ``[0, C)`` with a wrong loss).
- `check_torch_parameters`: once per fit, torch parameters of a subclass that require grad but
  that no optimizer updates (ORT gives no gradients for its graph's inputs).
- `precision_supported`, `check_can_train`, `check_model_outputs`: what a Trainer or a call asks
  of the artifacts.

Example::

    >>> precision_supported("32-true"), precision_supported("16-mixed")
    (True, False)
"""

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
    """Refuse a Trainer precision other than ``"32-true"``.

    Raises:
        ConfigurationError: naming the precision to use.
    """
    if not precision_supported(str(precision)):
        raise ConfigurationError(
            f"ORT training graphs run in float32, but the Trainer has precision={str(precision)!r}; "
            f"use Trainer(precision={SUPPORTED_PRECISION!r})."
        )


def check_can_train(artifacts: TrainingArtifacts) -> None:
    """Refuse to fit artifacts without an optimizer graph (``generate_artifacts(..., optimizer=None)``).

    Raises:
        ConfigurationError: naming the folder and the two ways to train it.
    """
    if artifacts.optimizer_model is None:
        raise ConfigurationError(
            f"{artifacts.directory} has no optimizer graph (generated with optimizer=None), so it can validate, "
            "test and predict but not fit; regenerate it with an optimizer, or pass "
            "ORTLightningModule(folder, optimizer=lambda params: torch.optim.SGD(params, lr=...))."
        )


def check_model_outputs(artifacts: TrainingArtifacts, fetched: int) -> None:
    """Refuse ``forward``/``predict`` on an eval graph whose only output is the loss.

    Raises:
        ConfigurationError: naming ``additional_output_names``, which keeps the model's outputs.
    """
    if fetched < 2:
        raise ConfigurationError(
            f"{artifacts.eval_model.name} outputs the loss only, so forward() and predict have no model output to "
            "return; generate the artifacts with generate_artifacts(..., additional_output_names=['<model output>']) "
            "(export_artifacts() keeps them), or run validate/test for the loss."
        )


def check_torch_parameters(module: torch.nn.Module, updated: Iterable[torch.Tensor]) -> None:
    """Refuse parameters of `module` that require grad but are not among the `updated` ones.

    A torch part in an ``ORTLightningModule`` subclass (a trunk in front of the graph) never gets
    a gradient: ORT's artifacts give none for their inputs, so it would silently stay as it is
    while ``ModelSummary`` counts it as trainable.

    Raises:
        ConfigurationError: naming those parameters, with how to freeze them or train them in ORT.

    Example::

        >>> root = torch.nn.Module()
        >>> root.trunk = torch.nn.Linear(2, 2)
        >>> check_torch_parameters(root.requires_grad_(False), [])
        >>> check_torch_parameters(root.requires_grad_(True), [])
        Traceback (most recent call last):
        ...
        ort_lightning.errors.ConfigurationError: Torch parameters ['trunk.weight', 'trunk.bias'] require grad, ...
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
