"""The benchmark harness runs in its quick mode, so that it cannot rot (no timing assertions)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_reports_every_runner_ratio_and_bridge_row(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--markdown", report],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert text.startswith("**SMOKE RUN (--quick)"), text[:200]  # 5 steps are noise: said before any table
    for runner in ("Lightning + ORT", "ORT loop", "Lightning + torch", "torch loop"):
        assert re.search(rf"\| mlp-small \| {re.escape(runner)} \| [\d.]+ \|", text), runner
    assert re.search(r"\| mlp-small \| [\d.]+x \| [\d.]+x \| [\d.]+x \|", text)
    assert len(re.findall(r"^\| (64|4096) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", text, re.MULTILINE)) == 2
    assert text in result.stdout


def test_soak_script_reports_rss_growth() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--steps", "300"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"steps: 300 .* growth after warm-up: [+-][\d.]+%", result.stdout)
