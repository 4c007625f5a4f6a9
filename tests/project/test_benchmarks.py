"""The benchmark harness runs in its quick mode, so that it cannot rot (no timing assertions)."""

from __future__ import annotations

import gc
import re
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from onnxruntime.training.api import CheckpointState, Module

from benchmarks import _probes
from benchmarks._models import CASES
from benchmarks._runners import LightningORT, ORTLoop, _fit, export
from benchmarks.overhead import ComputeClock, _TimedSession
from ort_lightning import export_artifacts
from tests.helpers import ROOT, RunIf, ort_deaths

#: A goal row of the quick report: goal, measured, unit, target, ceiling (or "-"), verdict.
GOAL_ROW = (r"^\| mlp-small \| (.+?) \| (-?[\d.]+) ?(ms|x) \| [<>]= (-?[\d.]+) ?(?:ms|x) \| (?:-|(-?[\d.]+)x) \| "
            r"(met|\*\*not met\*\*(?: \(out of reach: ORT's own step\))?) \|$")
NOT_MET, OUT_OF_REACH = "**not met**", "**not met** (out of reach: ORT's own step)"


def _verdicts(measured: float, unit: str, target: float, ceiling: float | None) -> set[str]:
    """The verdicts a goal row may print for its printed numbers: one, or two where a rounding tie leaves it open.

    Less is better in ms, more in x; a throughput goal not met whose ceiling is below its target is out of reach.
    """
    if measured == target:  # equal at the printed precision: either side of the target
        return {"met", NOT_MET, OUT_OF_REACH}
    if (measured <= target) if unit == "ms" else (measured >= target):
        return {"met"}
    if ceiling is None or ceiling > target:
        return {NOT_MET}
    return {OUT_OF_REACH} if ceiling < target else {NOT_MET, OUT_OF_REACH}


@pytest.mark.slow  # the benchmark scripts run as child processes
def test_quick_benchmark_reports_every_runner_ratio_and_bridge_row(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--markdown", report],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("**SMOKE RUN (--quick)"), text[:200]  # 5 steps are noise: said before any table
    ms = {}
    for runner in ("Lightning + ORT", "Lightning + ORT, threads=off", "Lightning + ORT-hybrid", "ORT loop",
                   "Lightning + torch", "torch loop"):
        row = re.search(rf"\| mlp-small \| {re.escape(runner)} \| ([\d.]+) \|", text)
        assert row is not None, runner
        ms[runner] = float(row.group(1))
    assert re.search(r"\| mlp-small \| [\d.]+x \| [\d.]+x \| [\d.]+x \| [\d.]+x \|", text)
    goals = re.findall(GOAL_ROW, text, re.MULTILINE)
    # NOTE: the ORT-loop goal applies to steps over 5 ms only, which a loaded machine may reach on mlp-small.
    assert [goal[0] for goal in goals if "ORT loop" not in goal[0]] == [
        "ms added by adapter+Lightning <= ms added by Lightning (torch) + 0.1",
        "throughput L+ORT / L+torch >= 1.25",
        "throughput L+ORT-hybrid / L+ORT >= 0.95 (a torch update costs no more than ORT's)",
        "throughput L+ORT / L+ORT threads=off >= 0.97 (default threads within 3 % of off)",
    ]
    for _, measured, unit, target, ceiling, verdict in goals:
        assert verdict in _verdicts(float(measured), unit, float(target), float(ceiling) if ceiling else None), goals
    # the overhead goal from the ratio table's two "ms added" columns, by the goal's own formula
    added = re.search(r"^\| mlp-small(?: \| [\d.]+x){4} \| (-?[\d.]+) \| (-?[\d.]+) \|$", text, re.MULTILINE)
    assert added is not None, text
    overhead = goals[0]
    assert float(overhead[1]) == float(added.group(1))
    assert abs(float(overhead[3]) - (float(added.group(2)) + 0.1)) <= 0.0011, (overhead, added.groups())
    # the default-threads goal from the two Lightning + ORT rows' ms/step: off / default, each printed to 0.0005 ms
    threads = next(goal for goal in goals if "threads=off" in goal[0])
    off, default = ms["Lightning + ORT, threads=off"], ms["Lightning + ORT"]
    low, high = (off - 0.0005) / (default + 0.0005), (off + 0.0005) / (default - 0.0005)
    assert low - 0.005 <= float(threads[1]) <= high + 0.005, (threads, ms)
    assert float(threads[3]) == 0.97
    assert len(re.findall(r"^\| (64|4096) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", text, re.MULTILINE)) == 2
    assert text in result.stdout


@pytest.mark.slow
def test_overhead_probe_times_every_step_of_every_runner() -> None:
    # NOTE: the probe refuses a block whose timed compute calls do not match its steps one to one.
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--cases", "mlp-small", "--rounds", "4", "--steps", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    row = (r"^\| mlp-small(?: \| [\d.]+){4} \| ([+-][\d.]+) \(([+-][\d.]+) to ([+-][\d.]+)\) \| (met|\*\*not met\*\*) "
           r"\| [\d.]+x \|$")
    found = re.search(row, result.stdout, re.MULTILINE)
    assert found is not None, result.stdout
    median, low, high = (float(found.group(i)) for i in (1, 2, 3))
    assert low <= median <= high, found.group(0)
    # the verdict: the median excess within the slack of 0.1 ms (either side where it prints as 0.10)
    expected = {"met", NOT_MET} if median == 0.1 else {"met" if median < 0.1 else NOT_MET}
    assert found.group(4) in expected, found.group(0)


def _soak(*options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--steps", "1200", "--max-kb-per-step", "1.0", *options],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )


@pytest.mark.slow
def test_soak_rss_stays_flat_and_a_leak_would_fail() -> None:
    # NOTE: allocator noise gives a slope of ~0.1-0.4 KB/step here; the bound is 1 KB/step, and the
    # control keeps 4 KB per step alive (as a leaked fetch buffer would) to prove the bound bites.
    result = _soak()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"steps: 1200 .* growth after warm-up: [+-][\d.]+%", result.stdout)
    slope = float(re.search(r"RSS slope after warm-up: ([+-][\d.]+) KB/step", result.stdout).group(1))  # type: ignore[union-attr]
    assert slope < 1.0
    leaking = _soak("--leak-kb", "4")
    assert leaking.returncode == 1, leaking.stdout[-2000:] + leaking.stderr[-2000:]
    assert "above the bound 1.0 KB/step: a leak" in leaking.stdout


@RunIf(cuda=False)  # where there is a GPU, the script runs for real
def test_gpu_script_without_a_gpu_says_so_and_fails(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # NOTE: `python -m benchmarks.gpu` as runpy runs it, in this process: a child process imported torch, Lightning
    # and ONNX Runtime again to print one line.
    monkeypatch.setattr(sys, "argv", ["benchmarks.gpu"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("benchmarks.gpu", run_name="__main__", alter_sys=True)
    assert exited.value.code == 2
    stderr = capsys.readouterr().err
    assert "benchmarks.gpu: cannot run: no CUDA GPU visible to torch" in stderr
    assert "Nothing was measured" in stderr


@pytest.mark.slow
def test_profile_lists_ort_and_torch_ops_side_by_side() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile", "--cases", "mlp-small", "--steps", "3"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # NOTE: a torch op's name may hold spaces and colons ("autograd::engine::evaluate_function: torch::...").
    first = r"^\| 1 \| [A-Z][\w ()]* \| [\d.]+ \| \d+% \| [^|\s][^|]*? \| [\d.]+ \| \d+% \|$"
    assert re.search(first, result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"\*\*all ORT kernels\*\* \| \*\*[\d.]+\*\*", result.stdout)
    assert "| Gemm |" in result.stdout or "| FusedGemm |" in result.stdout  # the linear layers' kernels
    assert "AdamWOptimizer (clock)" in result.stdout


# ----------------------------------------------------------------------------- the harness frees ORT in ORT's order
def test_the_ort_loop_frees_orts_module_before_its_state(tmp_path: Path) -> None:
    # NOTE: the overhead probe wraps the loop's bound calls; left to the attributes' order, the Python Module let
    # the state go while the calls still held ORT's C++ Module, whose destructor then wrote into the freed
    # state: `free(): invalid pointer` at the process's end, one run in ten (tests.helpers.ort_deaths).
    case = CASES["mlp-small"]
    loop = ORTLoop(case, export(case, tmp_path, verify=False))
    clock = ComputeClock()
    loop.train_step, loop.update = clock.timed(loop.train_step), clock.timed(loop.update, ends_step=True)
    assert len(loop.run(2)) == 2
    deaths = ort_deaths(loop.module, loop.state)
    del loop
    gc.collect()
    assert deaths == ["Module", "CheckpointState"]


def test_the_bridge_probe_frees_orts_module_before_its_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deaths: list[list[str]] = []

    def watched(training_model: str, state: CheckpointState, *args: Any, **options: Any) -> Module:
        module = Module(training_model, state, *args, **options)  # ORT's own, watched
        deaths.append(ort_deaths(module, state))
        return module

    monkeypatch.setattr(_probes, "Module", watched)
    linear = torch.nn.Linear(784, 10)
    artifacts = export_artifacts(linear, torch.zeros(2, 784), tmp_path / "linear", loss="cross_entropy", verify=False)
    rows = _probes.bridge_microseconds(artifacts, [4], repeats=3)
    assert [row[0] for row in rows] == [4]
    gc.collect()
    assert deaths == [["Module", "CheckpointState"]]


def test_the_timed_fit_lets_go_of_orts_calls(tmp_path: Path) -> None:
    # NOTE: the probe's callback kept ORT's bound calls after the fit; the Trainer and the module form a cycle, so
    # at the process's end the session was closed first and the callback's calls freed ORT's Module last.
    case = CASES["mlp-small"]
    runner = LightningORT(case, export(case, tmp_path, verify=False))
    clock = ComputeClock()
    intervals = _fit(runner.module, case.loader(3), _TimedSession(clock))
    assert len(clock.steps) == len(intervals) + 1 == 3
    session = runner.module.ort_session
    state, ort_module, _ = session.ort_objects
    deaths = ort_deaths(ort_module, state)
    del state, ort_module
    del session, runner
    gc.collect()
    assert deaths == ["Module", "CheckpointState"]


@pytest.mark.slow  # the benchmark's own script and its export child
def test_llama_benchmark_exports_a_tiny_llama_and_reports_each_process_peak() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.llama", "--quick", "--rounds", "0"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    gib = r"[\d.]+ GiB"
    row = (rf"^\| `export_artifacts` \(passed, verification [\d.]+ s\) \| [\d.]+ \| \d+ MB \| {gib} \| [\d.]+x \| "
           rf"{gib} \| {gib} \|$")
    assert re.search(row, result.stdout, re.MULTILINE), result.stdout[-3000:]


@pytest.mark.slow  # the benchmark's own script and its children
def test_fleet_lora_benchmark_counts_the_adapters_bytes_of_a_tiny_llama() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.fleet_lora", "--size", "tiny", "--devices", "2", "--rounds", "1",
         "--batches", "1", "--runs", "in-process"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    adapters = re.search(r"LoRA adapters ([\d.]+) kB of ([\d.]+) MB", result.stdout)
    assert adapters is not None, result.stdout
    # 2 layers x 8 x (q: 64 + 64, v: 64 + 32 for 2 key/value heads of 16) float32 values: 14,336 bytes; 8 .npy
    # headers of 128 bytes make 15,360
    assert float(adapters.group(1)) == 14.3
    row = re.search(r"^\| adapters only \| in-process \| ([\d.]+) kB / ([\d.]+) kB \| [\d.]+ \| nan \| [\d.]+ \|$",
                    result.stdout, re.MULTILINE)
    assert row is not None, result.stdout
    assert float(row.group(1)) == float(row.group(2)) == 15.4
