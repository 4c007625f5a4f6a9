"""Fault injection: SIGKILL at random moments, including during checkpoint writes.

The worker (tests/training/checkpointing/fault_worker.py) forks a training child per trial and kills it after a
random delay; after each kill every visible checkpoint must load, and resuming from the last
one must finish the run with parameters bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Exported
from tests.helpers import RunIf

pytestmark = pytest.mark.slow  # a worker process that forks and kills training children

TRIALS = 40
WORKER = Path(__file__).with_name("fault_worker.py")


@RunIf(fork=True)  # the worker forks one child per trial
def test_sigkill_never_loses_the_last_checkpoint(mlp_adamw: Exported, tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    result = subprocess.run(
        [sys.executable, str(WORKER), str(mlp_adamw.artifacts.directory), str(tmp_path),
         "--trials", str(TRIALS), "--seed", str(seed)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, f"seed {seed}: {result.stderr[-3000:]}"
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"fault injection (seed {seed}): {counts}")
    assert counts["trials"] == TRIALS
    assert counts["killed"] > TRIALS // 2, counts
    assert counts["verify_failures"] == 0, f"seed {seed}: {counts}\n{result.stderr[-3000:]}"
    assert counts["runs_completed"] >= 1
    assert counts["runs_identical"] == counts["runs_completed"], f"seed {seed}: {counts}"
