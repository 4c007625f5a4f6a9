"""``python -m benchmarks.gpu``: a short CUDA correctness run, then ORT CUDA and torch CUDA side by side.

Needs a CUDA GPU, torch's CUDA build and ONNX Runtime's CUDA training build
(``onnxruntime-training``, not ``-cpu``); without them it says which is missing and exits
with status 2, so that no one mistakes it for a passed run.

1. **Correctness**: the same model, initial weights, batches and optimizer, 20 steps under a
   ``Trainer(accelerator="gpu")``, against plain torch on the same GPU (TF32 off on both sides):
   ORT's own AdamW graph against ``torch.optim.AdamW``, and the hybrid optimizer (ORT's
   gradients, ``torch.optim.AdamW(fused=True)``) against the same torch optimizer. Fails (status
   1) beyond ``--atol``.
2. **Speed** (skip with ``--no-bench``): per model, milliseconds per step of Lightning + ORT,
   Lightning + ORT-hybrid, Lightning + torch and a torch loop, all on the GPU, interleaved over
   rounds as ``python -m benchmarks`` does; the clock stops after a CUDA synchronize.

Usage::

    python -m benchmarks.gpu                        # correctness, then every model
    python -m benchmarks.gpu --cases mlp-compute bert-tiny --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import onnxruntime
import torch

from benchmarks._models import CASES, Case
from benchmarks._runners import LR, TorchLightning, export, torch_adamw
from ort_lightning import ORTLightningModule, TrainingArtifacts

NO_GPU = 2
CORRECTNESS_STEPS = 20


def missing() -> str | None:
    """What this machine lacks for a GPU run, or None."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (a CPU build, or no driver/device)"
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (f"ONNX Runtime {onnxruntime.__version__} has no CUDAExecutionProvider "
                f"({onnxruntime.get_available_providers()}); install onnxruntime-training (the CUDA build) "
                "instead of onnxruntime-training-cpu")
    return None


class _SyncClock(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def _fit(module: pl.LightningModule, loader: Any, steps: int | None = None) -> list[float]:
    clock = _SyncClock()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_epochs=1, max_steps=steps or -1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[clock],
    )
    trainer.fit(module, loader)
    return [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]


def _torch_reference(case: Case, optimizer: Any, steps: int) -> dict[str, torch.Tensor]:
    model = case.model().cuda()
    opt = optimizer(model.parameters())
    for batch in case.loader(steps):
        case.loss(model, [t.cuda() for t in batch]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def correctness(case: Case, artifacts: TrainingArtifacts, atol: float) -> list[str]:
    """Train on the GPU with ORT's optimizer and with the hybrid one; compare with torch on the GPU."""
    failures = []
    runs = {
        "ORT AdamW graph": (ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant"),
                            lambda params: torch.optim.AdamW(params, lr=LR)),
        "hybrid AdamW(fused)": (ORTLightningModule(artifacts, optimizer=torch_adamw, lr_scheduler="constant"),
                                torch_adamw),
    }
    for label, (module, reference_optimizer) in runs.items():
        _fit(module, case.loader(CORRECTNESS_STEPS), CORRECTNESS_STEPS)
        ours = {name: p.detach().cpu() for name, p in module.named_parameters()}
        theirs = _torch_reference(case, reference_optimizer, CORRECTNESS_STEPS)
        worst = max((ours[name] - value).abs().max().item() for name, value in theirs.items())
        verdict = "ok" if worst <= atol else "FAILED"
        print(f"{case.name:12s} {label:20s} max |ORT - torch| after {CORRECTNESS_STEPS} steps: {worst:.2e} {verdict}")
        if worst > atol:
            failures.append(f"{case.name} {label}: {worst:.2e} > {atol:.0e}")
    return failures


class _TorchLoop:
    def __init__(self, case: Case) -> None:
        self.case, self.model = case, case.model().cuda()
        self.optimizer = torch_adamw(self.model.parameters())

    def run(self, steps: int) -> list[float]:
        stamps = []
        for batch in self.case.loader(steps + 1):
            self.case.loss(self.model, [t.cuda(non_blocking=True) for t in batch]).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


class _Lightning:
    def __init__(self, case: Case, module: pl.LightningModule) -> None:
        self.case, self.module = case, module

    def run(self, steps: int) -> list[float]:
        return _fit(self.module, self.case.loader(steps + 1))


def speed(case: Case, artifacts: TrainingArtifacts, rounds: int, steps: int) -> str:
    """One Markdown row: median ms per step of each GPU runner, interleaved over `rounds`."""
    runners: dict[str, Any] = {
        "L+ORT": _Lightning(case, ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant")),
        "L+ORT-hybrid": _Lightning(case, ORTLightningModule(artifacts, optimizer=torch_adamw,
                                                            lr_scheduler="constant")),
        "L+torch": _Lightning(case, TorchLightning(case)),
        "torch loop": _TorchLoop(case),
    }
    for runner in runners.values():
        runner.run(2)
    times: dict[str, list[float]] = {key: [] for key in runners}
    for round_index in range(rounds):
        keys = list(runners)
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            times[key].extend(runners[key].run(steps))
    ms = {key: statistics.median(values) * 1e3 for key, values in times.items()}
    cells = " | ".join(f"{ms[key]:.3f}" for key in runners)
    return f"| {case.name} | {cells} | {ms['L+torch'] / ms['L+ORT']:.2f}x | {ms['L+torch'] / ms['L+ORT-hybrid']:.2f}x |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--no-bench", action="store_true", help="the correctness run only")
    args = parser.parse_args(argv)
    reason = missing()
    if reason is not None:
        print(f"benchmarks.gpu: cannot run: {reason}. Nothing was measured.", file=sys.stderr)
        return NO_GPU
    # NOTE: TF32 matmuls would differ from ORT's fp32 kernels by ~1e-3 after a few steps.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}")
    rows = ["| model | L+ORT ms | L+ORT-hybrid ms | L+torch ms | torch loop ms | L+ORT / L+torch throughput "
            "| L+ORT-hybrid / L+torch |", "|---|---|---|---|---|---|---|"]
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ort-lightning-gpu-") as folder:
        for name in args.cases:
            case = CASES[name]
            artifacts = export(case, Path(folder))
            failures += correctness(case, artifacts, args.atol)
            if not args.no_bench:
                rows.append(speed(case, artifacts, args.rounds, args.steps))
    if not args.no_bench:
        print("\n".join(rows))
    if failures:
        print("GPU correctness FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
