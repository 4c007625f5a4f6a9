"""Time one ORT training step of models that need a rewrite, against the same model with a native op.

Run as ``python -m tools.time_rewrites [WORD...]`` (only the pairs whose name has a WORD).
Each pair differs in one layer: the rewritten one (left)
and one ORT differentiates natively at a similar cost (right); the ratio says what the rewrite
costs per step. AveragePool is compared with itself exported at a fixed batch (where the native
op trains). Steps are interleaved, and the median of several rounds is reported.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.bridge import BatchBinder
from ort_lightning.ort import runtime as _ort

BATCH, STEPS, ROUNDS = 32, 20, 7


def _cnn(act: Callable[[], nn.Module], norm: Callable[[int], nn.Module] = nn.BatchNorm2d,
         pool: Callable[[], nn.Module] = lambda: nn.MaxPool2d(2)) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), norm(32), act(), pool(),
        nn.Conv2d(32, 32, 3, padding=1), norm(32), act(), pool(),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )


PAIRS: list[tuple[str, Callable[[], nn.Module], Callable[[], nn.Module]]] = [
    ("HardSwish vs ReLU", lambda: _cnn(nn.Hardswish), lambda: _cnn(nn.ReLU)),
    ("HardSigmoid vs Sigmoid", lambda: _cnn(nn.Hardsigmoid), lambda: _cnn(nn.Sigmoid)),
    ("ELU vs ReLU", lambda: _cnn(nn.ELU), lambda: _cnn(nn.ReLU)),
    ("Mish (Softplus) vs SiLU", lambda: _cnn(nn.Mish), lambda: _cnn(nn.SiLU)),
    ("GroupNorm vs BatchNorm", lambda: _cnn(nn.ReLU, lambda c: nn.GroupNorm(8, c)), lambda: _cnn(nn.ReLU)),
    ("AvgPool (dynamic batch, rewritten) vs AvgPool (fixed batch, native)",
     lambda: _cnn(nn.ReLU, pool=lambda: nn.AvgPool2d(2)), lambda: _cnn(nn.ReLU, pool=lambda: nn.AvgPool2d(2))),
    ("AvgPool (rewritten) vs MaxPool", lambda: _cnn(nn.ReLU, pool=lambda: nn.AvgPool2d(2)), lambda: _cnn(nn.ReLU)),
]


def _fixed_batch_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model).train(), (example,), str(path), dynamo=False, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["input"], output_names=["logits"])
    return path


def _stepper(folder: Path) -> Callable[[], None]:
    artifacts = TrainingArtifacts.load(folder)
    session = _ort.assemble(training_model=artifacts.training_model, eval_model=artifacts.eval_model,
                            optimizer_model=artifacts.optimizer_model, checkpoint=artifacts.checkpoint)
    binder = BatchBinder([*artifacts.manifest.inputs, *artifacts.manifest.labels], torch.device("cpu"),
                         graph="training")
    generator = torch.Generator().manual_seed(0)
    batch = binder([torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(0, 10, (BATCH,))])

    def step() -> None:
        session.train_step(batch)
        session.optimizer_step()
        session.lazy_reset_grad()

    return step


def _time(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - start) / STEPS * 1e3


def main() -> int:
    """Print the step time of each pair and their ratio."""
    print(f"| pair | rewritten ms/step | native ms/step | ratio |  (batch {BATCH}, 3x32x32, median of {ROUNDS})")
    print("|---|---|---|---|")
    example = torch.zeros(BATCH, 3, 32, 32)
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, rewritten, native) in enumerate(PAIRS):
            if len(sys.argv) > 1 and not any(word in name for word in sys.argv[1:]):
                continue
            torch.manual_seed(0)
            left = _stepper(export_artifacts(rewritten(), example[:4], Path(scratch) / f"{index}a").directory)
            source: object = native()
            if "fixed batch" in name:
                source = _fixed_batch_onnx(source, example, Path(scratch) / f"{index}.onnx")  # type: ignore[arg-type]
            right = _stepper(export_artifacts(source, example[:4], Path(scratch) / f"{index}b").directory)  # type: ignore[arg-type]
            left(), right()
            times = [(_time(left), _time(right)) for _ in range(ROUNDS)]
            a, b = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
            print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
