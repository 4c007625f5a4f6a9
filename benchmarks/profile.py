"""``python -m benchmarks.profile``: which kernels take a training step's time, in ORT and in torch.

For each model, the same training steps (forward, backward, AdamW update) run once under ONNX
Runtime's own profiler (``SessionOptions.enable_profiling`` on the training, eval and optimizer
sessions) and once under ``torch.profiler``; the ops' self times are summed per op type and
shown side by side, per step. This is what says where ORT's CPU kernels lose to torch's.

Usage::

    python -m benchmarks.profile                          # every model, 20 steps each
    python -m benchmarks.profile --cases bert-tiny --steps 10 --markdown profile.md
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from onnxruntime.training.api import CheckpointState, Module, Optimizer

from benchmarks._models import CASES, Case
from benchmarks._runners import LR, export, torch_adamw
from ort_lightning import TrainingArtifacts
from ort_lightning.bridge import BatchBinder
from ort_lightning.ort import runtime as _ort

TOP = 8


def ort_profile(case: Case, artifacts: TrainingArtifacts, steps: int, folder: Path) -> dict[str, float]:
    """Milliseconds per step spent in each ORT op type of the training graph, and in the optimizer update."""
    options = _ort.session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / f"ort-{case.name}")
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model), device="cpu",
                    session_options=options)
    optimizer = Optimizer(str(artifacts.optimizer_model), module)
    optimizer.set_learning_rate(LR)
    module.train()
    binder = BatchBinder(artifacts.manifest.graph_inputs, torch.device("cpu"), graph="training")
    train, update, reset = module._model.train_step_with_ort_values, optimizer._optimizer.optimizer_step, \
        module._model.lazy_reset_grad
    from onnxruntime.capi._pybind_state import OrtValueVector

    update_ms = 0.0
    for batch in case.loader(steps):
        train(binder(list(batch)), OrtValueVector())
        start = time.perf_counter()
        update()
        update_ms += (time.perf_counter() - start) * 1e3
        reset()
    # NOTE: ORT writes a session's profile when the session is destroyed (the training Module
    # has no end_profiling). The training, eval and optimizer sessions share the options and
    # name their files by the second, so only one file survives: the optimizer's update is
    # timed by the clock instead (its graph is one AdamWOptimizer node).
    # NOTE: the bound calls hold ORT's C++ Module, which writes into the state when it goes: they go first.
    del train, update, reset, optimizer, module, state
    gc.collect()
    totals: dict[str, float] = defaultdict(float)
    totals["AdamWOptimizer (clock)"] = update_ms / steps
    for path in folder.glob(f"ort-{case.name}*.json"):
        for event in _events(path.read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                totals[event["args"]["op_name"]] += event["dur"] / 1e3 / steps
    return dict(totals)


def _events(text: str) -> list[dict]:
    """The events of an ORT profile, one JSON object a line; lines that two sessions garbled are skipped.

    NOTE: sessions created in the same second write the same file name; the file may then
    hold the tail of one session's events after another's closing bracket.
    """
    events = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{") and line.endswith("}"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def torch_profile(case: Case, steps: int) -> dict[str, float]:
    """Milliseconds per step of self CPU time in each torch op (forward, backward, fused AdamW)."""
    model = case.model()
    optimizer = torch_adamw(model.parameters())
    batches = list(case.loader(steps))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for batch in batches:
            case.loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    averages = profiler.key_averages()
    return {event.key: event.self_cpu_time_total / 1e3 / steps for event in averages if event.self_cpu_time_total > 0}


def _top(times: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(times.items(), key=lambda item: -item[1])[:TOP]


def side_by_side(case: Case, ort: dict[str, float], torch_times: dict[str, float]) -> list[str]:
    """A Markdown table of the top ops of each, with their share of the kernel total."""
    ort_total, torch_total = sum(ort.values()), sum(torch_times.values())
    lines = [
        f"### {case.name} (batch {case.batch_size})",
        "",
        "| # | ORT op | ms/step | share | torch op | ms/step | share |",
        "|---|---|---|---|---|---|---|",
    ]
    left, right = _top(ort), _top(torch_times)
    for rank in range(max(len(left), len(right))):
        a = f"{left[rank][0]} | {left[rank][1]:.2f} | {left[rank][1] / ort_total:.0%}" if rank < len(left) else " | |"
        b = (f"{right[rank][0]} | {right[rank][1]:.2f} | {right[rank][1] / torch_total:.0%}"
             if rank < len(right) else " | |")
        lines.append(f"| {rank + 1} | {a} | {b} |")
    lines.append(f"| | **all ORT kernels** | **{ort_total:.2f}** | | **all torch ops (self)** | "
                 f"**{torch_total:.2f}** | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    lines = [f"Kernel profiles, {args.steps} training steps per model (warm-up included), "
             f"torch {torch.__version__} ({torch.get_num_threads()} threads), fused AdamW on the torch side.", ""]
    with tempfile.TemporaryDirectory(prefix="ort-lightning-profile-") as folder:
        for name in args.cases:
            case = CASES[name]
            # NOTE: unverified: the profile lists kernels; `python -m benchmarks` verifies each case's export.
            artifacts = export(case, Path(folder), verify=False)
            lines += [*side_by_side(case, ort_profile(case, artifacts, args.steps, Path(folder)),
                                    torch_profile(case, args.steps)), ""]
            print(f"profiled {name}", file=sys.stderr, flush=True)
    report = "\n".join(lines)
    print(report)
    if args.markdown:
        args.markdown.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
