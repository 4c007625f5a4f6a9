"""Guards of `ORTLightningModule` against inputs that ONNX Runtime would train on silently.

ORT 1.19.2 computes a cross-entropy loss with labels outside ``[0, C)`` without complaint
(the loss is simply wrong), and a NaN or infinite loss turns every parameter into NaN at the
next optimizer update. These guards cost one cheap reduction per step on the happy path:

- `LabelRange`: one ``torch.aminmax`` over the label tensor, for cross-entropy and NLL artifacts
  only (a second, masked one for batches that hold `ignore_index` labels).
- `NonFiniteGuard`: one ``math.isfinite`` on the 0-d loss; once per optimizer step, decided by all
  ranks together, ``"raise"`` stops before the update, ``"skip"`` drops the whole step and warns.
- `check_graph_inputs`: once at assembly, the manifest's inputs against the graph's own.
- `check_torch_parameters`: once per fit, torch parameters of a subclass that require grad but
  that no optimizer updates (ORT gives no gradients for its graph's inputs).

Example::

    >>> import torch
    >>> guard = LabelRange("labels", index=1, classes=3)
    >>> guard((torch.zeros(2, 4), torch.tensor([0, 2])), graph="training")
    >>> guard((torch.zeros(2, 4), torch.tensor([0, 3])), graph="training")
    Traceback (most recent call last):
    ...
    ort_lightning.errors.BatchError: Labels 'labels' of the training graph must be class indices in [0, 3), ...
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import onnx
import torch

from ort_lightning.artifacts import MANIFEST_NAME, TensorSpec
from ort_lightning.errors import ArtifactError, BatchError, ConfigurationError, NonFiniteLossError

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = [
    "POLICIES",
    "SUPPORTED_PRECISION",
    "LabelRange",
    "NonFiniteGuard",
    "check_can_train",
    "check_model_outputs",
    "check_graph_inputs",
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

#: What `ORTLightningModule(on_nonfinite=...)` accepts.
POLICIES = ("raise", "skip")

_ADVICE = "lower the lr, check the data for NaN/inf values, or pass ORTLightningModule(on_nonfinite='skip')"


class NonFiniteGuard:
    """Watch each training loss; refuse or drop the optimizer step that a NaN/inf loss would poison.

    The decision is made once per optimizer step, after the window's last micro-batch and
    before the gradients are averaged across ranks or the update runs, and it is shared by all
    ranks (``trainer.strategy.reduce_boolean_decision``): under ``ort_ddp`` every rank skips
    together or every rank raises, so no rank waits in a collective the others left and no
    rank's NaN gradients reach the others' parameters.

    Args:
        policy: ``"raise"`` raises `NonFiniteLossError` before ORT's update; ``"skip"`` drops the
            optimizer update (every micro-batch of it; the gradients are reset) and warns.

    Raises:
        ConfigurationError: for another policy.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ConfigurationError(
                f"Expected argument `on_nonfinite` to be one of {list(POLICIES)}, but got {policy!r}; "
                "'raise' stops training at a NaN/inf loss, 'skip' drops that optimizer step and warns."
            )
        self.policy = policy
        self.skipped = 0
        self._pending: str | None = None

    def observe(self, loss: torch.Tensor, trainer: Any, batch_idx: int) -> None:
        """Check one micro-batch's loss; the `trainer`'s progress names the step in messages."""
        # NOTE: the loss is a 0-d view of ORT's output; .item() reads one number (ORT's run has
        # already finished, so this adds no wait on a GPU either).
        value = loss.item()
        if not math.isfinite(value) and self._pending is None:
            self._pending = f"{value} {_where(trainer, batch_idx)}"

    def decide(self, trainer: Any) -> bool:
        """Whether this optimizer step is skipped; every rank gets the same answer.

        Raises:
            NonFiniteLossError: under ``"raise"``, on every rank, when any rank saw a NaN/inf loss.
        """
        pending, self._pending = self._pending, None
        bad = pending is not None
        if trainer.world_size > 1:
            bad = trainer.strategy.reduce_boolean_decision(bad, all=False)
        if not bad:
            return False
        where = pending or f"non-finite on another rank at global_step={trainer.global_step}"
        if self.policy == "raise":
            raise NonFiniteLossError(
                f"The training loss is {where}; ORT's optimizer update has not run, so the parameters are "
                f"still finite. To go on: {_ADVICE}."
            )
        self.skipped += 1
        warnings.warn(
            f"Skipped an optimizer step: the loss was {where}. The parameters and the optimizer state are "
            f"unchanged and the gradients were reset ({self.skipped} step(s) skipped so far); if this repeats, "
            "lower the lr or check the data for NaN/inf values.",
            RuntimeWarning,
            stacklevel=2,
        )
        return True


def _where(trainer: Any, batch_idx: int) -> str:
    return f"at global_step={trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"


class LabelRange:
    """Refuse cross-entropy labels outside ``[0, classes)`` (ORT trains on them with a wrong loss).

    Args:
        name: the label input's name.
        index: its position among the graph's inputs.
        classes: the number of classes (the class axis of the logits).
        ignore_index: a label value the loss skips (torch's ``ignore_index``, -100 by default;
            Hugging Face pads labels with it); None when every label counts.
    """

    def __init__(self, name: str, *, index: int, classes: int, ignore_index: int | None = None) -> None:
        self.name = name
        self.index = index
        self.classes = classes
        self.ignore_index = ignore_index

    def __call__(self, tensors: Sequence[torch.Tensor], *, graph: str) -> None:
        """Check the labels among `tensors` (in graph-input order).

        Raises:
            BatchError: naming the labels, the range found and the range expected.
        """
        labels = tensors[self.index]
        if labels.numel() == 0 or labels.is_floating_point():
            return  # the binder refuses empty batches and other dtypes with messages of their own
        low, high = (int(value) for value in torch.aminmax(labels))
        if self.ignore_index is not None and self.ignore_index in (low, high):
            # NOTE: only batches that hold ignored labels pay for the second, masked reduction.
            low, high = self._counted_range(labels, low, high)
        if low < 0 or high >= self.classes:
            ignored = f" besides ignore_index={self.ignore_index}" if self.ignore_index is not None else ""
            raise BatchError(
                f"Labels {self.name!r} of the {graph} graph must be class indices in [0, {self.classes}){ignored}, but "
                f"the batch has values in [{low}, {high}] (ORT would train on them silently with a wrong loss); fix "
                f"the labels in your Dataset, re-export the model with as many classes as the labels need, or pass "
                "ORTLightningModule(check_labels=False) to skip this check."
            )

    def _counted_range(self, labels: torch.Tensor, low: int, high: int) -> tuple[int, int]:
        """The range of the labels other than `ignore_index` (``(0, 0)`` when all are ignored)."""
        counted = labels[labels != self.ignore_index]
        if counted.numel() == 0:
            return 0, 0
        return tuple(int(value) for value in torch.aminmax(counted))  # type: ignore[return-value]


def label_range_of(artifacts: TrainingArtifacts) -> LabelRange | None:
    """The label check for cross-entropy/NLL artifacts whose logits have a fixed class axis; None otherwise."""
    manifest = artifacts.manifest
    if manifest.loss not in ("cross_entropy", "nll") or not manifest.labels or not manifest.outputs:
        return None
    if artifacts.eval_model.suffix != ".onnx":  # an .ort graph: ONNX Runtime's format, not onnx's
        return None
    graph = onnx.load(artifacts.eval_model, load_external_data=False).graph
    logits = {output.name: output for output in graph.output}.get(manifest.outputs[0])
    if logits is None:
        return None
    dims = logits.type.tensor_type.shape.dim
    classes = dims[1].dim_value if len(dims) >= 2 else 0
    if classes <= 0:
        return None
    ignore_index = manifest.loss_options.get("ignore_index")
    return LabelRange(manifest.labels[0].name, index=len(manifest.inputs), classes=classes, ignore_index=ignore_index)


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


def check_graph_inputs(artifacts: TrainingArtifacts, user_inputs: Sequence[str]) -> None:
    """Refuse a manifest whose inputs are not the training graph's (a manifest of another model).

    Args:
        artifacts: the artifacts whose manifest is checked.
        user_inputs: the training graph's user inputs in order, as ONNX Runtime reports them.

    Raises:
        ArtifactError: naming what the manifest says and what the graph takes.
    """
    if artifacts.adopted:  # the manifest was read from this very graph
        return
    graph = onnx.load(artifacts.training_model, load_external_data=False).graph
    found = {info.name: TensorSpec.from_value_info(info) for info in graph.input}
    actual = [found[name] for name in user_inputs if name in found]
    described = list(artifacts.manifest.graph_inputs)
    if [(s.name, s.dtype, tuple(s.shape)) for s in described] == [(s.name, s.dtype, tuple(s.shape)) for s in actual]:
        return
    raise ArtifactError(
        f"{artifacts.directory / MANIFEST_NAME} describes the inputs {_describe(described)}, but "
        f"{artifacts.training_model.name} takes {_describe(actual)}; the manifest belongs to another model. "
        "Re-export the artifacts with export_artifacts() instead of copying files between folders."
    )


def _describe(specs: Sequence[TensorSpec]) -> str:
    return "[" + ", ".join(f"{s.name}: {s.dtype}{list(s.shape)}" for s in specs) + "]"


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
