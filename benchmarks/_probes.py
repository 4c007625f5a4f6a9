"""Machine and bridge probes: matmul peak, batch -> OrtValue cost, peak memory of a runner."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from onnxruntime.capi._pybind_state import OrtValueVector
from onnxruntime.training.api import CheckpointState, Module

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.bridge import BatchBinder


def _median_seconds(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak_gflops(size: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of a float32 square matmul on torch's CPU threads: the machine's practical peak."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def bridge_microseconds(
    artifacts: TrainingArtifacts, batch_sizes: list[int], repeats: int = 200
) -> list[tuple[int, float, float, float]]:
    """Cost of feeding a batch to ORT, per batch size: ``(batch, binder µs, DLPack step µs, numpy step µs)``.

    `artifacts` come from a linear 784 -> 10 classifier, so that the graph's own work stays
    small next to the feeding. The binder column is the package's DLPack wrapping alone; the
    step columns run one ORT train step fed through the binder, or fed numpy arrays as ORT's
    own ``Module.__call__`` is (which copies the inputs in and the outputs out).
    """
    state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
    module = Module(str(artifacts.training_model), state, str(artifacts.eval_model), device="cpu")
    binder = BatchBinder(artifacts.manifest.graph_inputs, torch.device("cpu"), graph="training")
    # NOTE: ORT's bound calls hold its C++ Module, which writes into the state when it is destroyed: they live
    # in `_bridge_rows` alone, so that they are gone before this frame lets the state go.
    return _bridge_rows(module, binder, batch_sizes, repeats)


def _bridge_rows(module: Module, binder: BatchBinder, batch_sizes: list[int],
                 repeats: int) -> list[tuple[int, float, float, float]]:
    train, reset = module._model.train_step_with_ort_values, module._model.lazy_reset_grad
    rows = []
    for batch in batch_sizes:
        x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))

        def dlpack_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            train(binder((x, y)), OrtValueVector())
            reset()

        def numpy_step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            module(x.numpy(), y.numpy())
            reset()

        wrap = _median_seconds(lambda x=x, y=y: binder((x, y)), repeats)
        rows.append((batch, wrap * 1e6, _median_seconds(dlpack_step, repeats) * 1e6,
                     _median_seconds(numpy_step, repeats) * 1e6))
    return rows


def peak_rss_mb(case: str, runner: str, steps: int) -> float:
    """Peak resident memory of a fresh process that builds `runner` for `case` and trains `steps` steps.

    The child runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``): by default glibc
    raises it when a large block is freed, so the memory freed while the data was built stays in its
    heap and a runner reuses it without adding resident pages (mlp-compute's torch loop read 2.5 MB,
    35 MB with the threshold fixed; BENCHMARKS.md "Memory of one fit").
    """
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--memory-child", case, runner, str(steps)],
        capture_output=True, text=True, check=True, timeout=600,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    return float(result.stdout.strip().splitlines()[-1])


def reset_peak_rss() -> None:
    """Restart this process's peak-RSS count (Linux: VmHWM), so that setup before it does not count."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def own_peak_rss_mb() -> float:
    """This process's peak resident memory in MB since start or the last `reset_peak_rss`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
