"""``python -m benchmarks.web``: a training step of the device runner in Node (WebAssembly) against ORT's Python loop.

Both sides train the same device folder of the digits MLP (64 -> 64 -> 10, 4,810 parameters,
``.ort`` and ``.onnx`` graphs, the nominal checkpoint plus the weights) on the same batches of 32
digits: ONNX Runtime's documented Python loop (``train_step``, ``optimizer.step()``,
``lazy_reset_grad()``) and ``ort_lightning/web/runner.js`` on onnxruntime-web 1.19.2's training
build under Node. Both run on one thread (a page without cross-origin isolation gets one; ORT's
Python session is given one), so that the ratio compares the runtimes, not their thread pools.
Rounds alternate the sides; each round is a fresh Node process, so its first step includes
compiling the WebAssembly, as a page's first step does. Node runs twice per round: as a page runs
(V8 starts the 12 MB module on its baseline compiler and optimizes the hot functions while it
trains, so the first thousands of steps are slower than the later ones), and compiled ahead
(``--no-liftoff --no-wasm-lazy-compilation``: every function optimized before the first step, the
steady state of a long run). Reported per graph format: the median over rounds of the
milliseconds per step after the first (wall clock and the process's CPU time), of the first step
(session creation + weights + one step), and the ratios to Python. The load average is printed
with them: on a busy machine the wall clock inflates, the CPU time less so.
Needs ``node`` and ``npm install onnxruntime-web@1.19.2``.

Usage::

    python -m benchmarks.web                  # 3 rounds of 400 steps per side and format
    python -m benchmarks.web --rounds 5 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from onnxruntime import OrtValue, SessionOptions
from onnxruntime.training.api import CheckpointState, Module, Optimizer
from sklearn.datasets import load_digits

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import digits_mlp
from ort_lightning.errors import ConfigurationError
from ort_lightning.web import asset, find_ort_web

NODE_SCRIPT = Path(__file__).with_name("web_node.mjs")
BATCH = 32
BATCHES = 8
MISSING = 2


def _device_folder(root: Path) -> tuple[Path, np.ndarray]:
    """The digits MLP's device folder (no complete checkpoint) and its weights, flat in parameter_order."""
    artifacts = export_artifacts(
        digits_mlp(), torch.zeros(2, 64), root / "server", verify=False, ort_format=True, nominal_checkpoint=True
    )
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    order = TrainingArtifacts.load(artifacts.directory).manifest.parameter_order
    weights = np.concatenate([np.array(state.parameters[name].data).ravel() for name in order]).astype(np.float32)
    device = shutil.copytree(artifacts.directory, root / "device", ignore=shutil.ignore_patterns("checkpoint"))
    return Path(device), weights


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    features, labels = load_digits(return_X_y=True)
    return [((features[i * BATCH:(i + 1) * BATCH] / 16.0).astype(np.float32),
             labels[i * BATCH:(i + 1) * BATCH].astype(np.int64)) for i in range(BATCHES)]


def _job(work: Path, folder: Path, graphs: str, weights: np.ndarray, steps: int, dist: str) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    weights.astype("<f4").tofile(work / "weights.bin")
    listed = []
    for index, (features, labels) in enumerate(_batches()):
        features.astype("<f4").tofile(work / f"x{index}.bin")
        labels.astype("<i8").tofile(work / f"y{index}.bin")
        listed.append([{"file": f"x{index}.bin", "type": "float32", "dims": list(features.shape)},
                       {"file": f"y{index}.bin", "type": "int64", "dims": list(labels.shape)}])
    job = {"dist": dist, "runner": str(asset("runner.js")), "folder": str(folder), "format": graphs,
           "weights": "weights.bin", "batches": listed, "steps": steps}
    (work / "job.json").write_text(json.dumps(job), encoding="utf-8")
    return work / "job.json"


#: Node's flags per variant: as a page runs (V8's default tiering), and with every function optimized ahead.
NODE_VARIANTS = {"node": (), "node-ahead": ("--no-liftoff", "--no-wasm-lazy-compilation")}


def node_round(job: Path, flags: tuple[str, ...]) -> dict[str, float]:
    """One fresh Node process: import, first step and per-step milliseconds (see web_node.mjs)."""
    node = shutil.which("node")
    assert node is not None
    result = subprocess.run(
        [node, *flags, str(NODE_SCRIPT), str(job)], capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(result.stdout.splitlines()[-1])


def python_round(folder: Path, graphs: str, weights: np.ndarray, steps: int) -> dict[str, float]:
    """ORT's documented Python loop on the same files: first step (session + weights + a step), then per step."""
    batches = _batches()
    options = SessionOptions()
    options.intra_op_num_threads = 1
    start = time.perf_counter()
    state = CheckpointState.load_checkpoint(str(folder / "nominal_checkpoint"))
    module = Module(str(folder / f"training_model.{graphs}"), state, str(folder / f"eval_model.{graphs}"),
                    session_options=options)
    # NOTE: the binding takes the C-level OrtValue (ORT 1.19.2's wrapper passes the Python one and fails).
    module._model.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(weights)._ortvalue, False)
    optimizer = Optimizer(str(folder / f"optimizer_model.{graphs}"), module)
    module.train()
    module(*batches[0])
    optimizer.step()
    module.lazy_reset_grad()
    first = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        module(*batches[step % len(batches)])
        optimizer.step()
        module.lazy_reset_grad()
    return {"firstStepMs": first * 1e3, "stepMs": (time.perf_counter() - start) * 1e3 / steps,
            "stepCpuMs": (time.process_time() - cpu) * 1e3 / steps}


def measure(rounds: int, steps: int, dist: str) -> dict[str, dict[str, list[float]]]:
    """Per graph format, per side and timing: one value per round, the sides alternating within each round."""
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as work:
        folder, weights = _device_folder(Path(work))
        for graphs in ("ort", "onnx"):
            job = _job(Path(work) / f"job-{graphs}", folder, graphs, weights, steps, dist)
            series = results.setdefault(graphs, {})
            for _ in range(rounds):
                sides = {name: node_round(job, flags) for name, flags in NODE_VARIANTS.items()}
                sides["python"] = python_round(folder, graphs, weights, steps)
                for side, timings in sides.items():
                    for key, value in timings.items():
                        series.setdefault(f"{side} {key}", []).append(float(value))
    return results


def report(results: dict[str, dict[str, list[float]]], rounds: int, steps: int) -> str:
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    lines = [f"Digits MLP (4,810 parameters), batch {BATCH}, one thread per side, {rounds} rounds of {steps} steps "
             f"per side; medians, ms; load average {load} on {os.cpu_count()} cores.", "",
             "| graphs | measure | Python loop | Node (as a page) | / Python | Node (compiled ahead) | / Python |",
             "|---|---|---|---|---|---|---|"]
    measures = (("stepMs", "step, wall clock", 3), ("stepCpuMs", "step, CPU time", 3),
                ("firstStepMs", "first step (session + weights + step)", 1))
    for graphs, series in results.items():
        median = {key: statistics.median(values) for key, values in series.items()}
        for key, label, digits in measures:
            python, page, ahead = (median[f"{side} {key}"] for side in ("python", "node", "node-ahead"))
            lines.append(f"| .{graphs} | {label} | {python:.{digits}f} | {page:.{digits}f} | {page / python:.1f}x "
                         f"| {ahead:.{digits}f} | {ahead / python:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.web", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--dist", default=None, help="onnxruntime-web's dist/ folder (default: find_ort_web())")
    options = parser.parse_args(argv)
    if shutil.which("node") is None:
        print("benchmarks.web needs node (Node.js 20) on PATH", file=sys.stderr)
        return MISSING
    try:
        dist = find_ort_web(options.dist)
    except ConfigurationError as error:
        print(error, file=sys.stderr)
        return MISSING
    print(report(measure(options.rounds, options.steps, dist), options.rounds, options.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
