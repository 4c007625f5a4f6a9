"""One training step of a torch model through real ORT artifacts, compared with torch autograd.

`torch_step` is the one torch side of such comparisons (the tests' references use it too);
the export verifier keeps its own float64 reference with a float32 noise model
(`ort_lightning.export.verify.reference`), which judges rather than measures.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ort_lightning import export_artifacts
from ort_lightning.bridge import BatchBinder, to_torch
from ort_lightning.ort import runtime as _ort

__all__ = ["StepResult", "compare_step", "torch_step"]


@dataclass(frozen=True)
class StepResult:
    """How one ORT training step compares with torch on the same weights and batch."""

    loss_diff: float
    output_diff: float
    output_rel: float  # output_diff relative to the largest |output| of torch
    grad_diff: float  # max |g_ort - g_torch| over all parameters
    grad_rel: float  # grad_diff relative to the largest |g_torch| of that parameter
    worst: str  # the parameter with the largest relative difference
    finite: bool  # ORT's loss and every gradient are finite
    eval_rel: float  # the eval graph's output vs the torch model in eval mode, relative to its largest |value|


def torch_step(
    model: torch.nn.Module, compute: Callable[[torch.nn.Module], torch.Tensor]
) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of plain torch autograd in training mode: the loss `compute` returns and the gradients by name.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> loss, grads = torch_step(model, lambda m: m(torch.ones(3, 2)).sum())
        >>> sorted(grads), grads["bias"].item()
        (['bias', 'weight'], 3.0)
    """
    model.train()
    model.zero_grad()
    loss = compute(model)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ort_step(
    folder: Path, batch: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    from ort_lightning import TrainingArtifacts

    artifacts = TrainingArtifacts.load(folder)
    session = _ort.assemble(
        training_model=artifacts.training_model, eval_model=artifacts.eval_model,
        optimizer_model=artifacts.optimizer_model, checkpoint=artifacts.checkpoint,
    )
    specs = [*artifacts.manifest.inputs, *artifacts.manifest.labels]
    binder = BatchBinder(specs, torch.device("cpu"), graph="training")
    # NOTE: the eval graph first, while the parameters and running statistics are the exported ones.
    evaluated = to_torch(session.eval_step(binder(batch))[1]).clone()
    fetches = session.train_step(binder(batch))
    loss, output = to_torch(fetches[0]).clone(), to_torch(fetches[1]).clone()
    grads = {name: to_torch(grad).clone() for name, _, grad, _ in session.parameters() if grad is not None}
    return loss, output, grads, evaluated


def compare_step(
    model: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    batch: tuple[torch.Tensor, ...],
    *,
    folder: Path | None = None,
    seed: int = 0,
    source: object = None,
    verify: bool = True,
) -> StepResult:
    """Export `model` at `example`, run one ORT train step (MSE loss) on `batch`, compare with torch.

    `source` (an ONNX file or ModelProto of `model`) is exported instead of the torch module when given.
    `verify` is `export_artifacts`' own: its child process adds nothing where the caller compares the
    gradients itself (the layers that draw random numbers are the exception: only the verifier compares
    their gradients, at a Dropout ratio of 0).

    Raises:
        ExportError: when the model cannot be exported or legalized.
    """
    reference = copy.deepcopy(model).train()
    with tempfile.TemporaryDirectory() as scratch:
        target_folder = folder or Path(scratch) / "artifacts"
        export_artifacts(
            source if source is not None else model, example, target_folder, loss="mse", verify=verify  # type: ignore[arg-type]
        )
        with torch.no_grad():
            shape = copy.deepcopy(reference)(*batch).shape
        target = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        ort_loss, ort_output, ort_grads, ort_eval = _ort_step(target_folder, [*batch, target])
    with torch.no_grad():
        torch_eval = copy.deepcopy(reference).eval()(*batch)
    outputs: list[torch.Tensor] = []

    def mse(module: torch.nn.Module) -> torch.Tensor:
        outputs.append(module(*batch))
        return F.mse_loss(outputs[0], target)

    loss_value, torch_grads = torch_step(reference, mse)
    torch_loss, torch_output = torch.tensor(loss_value), outputs[0].detach()
    grad_diff, grad_rel, worst = 0.0, 0.0, ""
    # NOTE: a parameter whose true gradient is ~0 (a conv bias before a normalization) is measured
    # against 1e-3 of the model's largest gradient, not divided by ~0.
    floor = 1e-3 * max((float(g.abs().max()) for g in torch_grads.values()), default=1.0)
    for name, grad in torch_grads.items():
        diff = float((ort_grads[name] - grad).abs().max())
        rel = diff / max(float(grad.abs().max()), floor, 1e-12)
        grad_diff = max(grad_diff, diff)
        if rel >= grad_rel:
            grad_rel, worst = rel, name
    return StepResult(
        loss_diff=float((ort_loss - torch_loss).abs()),
        output_diff=float((ort_output - torch_output).abs().max()),
        output_rel=float((ort_output - torch_output).abs().max() / torch_output.abs().max().clamp_min(1e-12)),
        grad_diff=grad_diff,
        grad_rel=grad_rel,
        worst=worst,
        eval_rel=float((ort_eval - torch_eval).abs().max() / torch_eval.abs().max().clamp_min(1e-12)),
        finite=bool(torch.isfinite(ort_loss).all()) and all(bool(torch.isfinite(g).all()) for g in ort_grads.values()),
    )
