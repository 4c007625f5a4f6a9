"""A NaN loss on one ``ort_ddp`` rank: every rank skips together or every rank raises, never a hang.

Two real gloo processes; the reference is plain torch on the double batch with the poisoned
step left out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import LAUNCH_VARIABLES, Exported
from tests.helpers import ROOT
from tests.strategies import ddp_nonfinite_run as run
from tests.strategies import ddp_run

pytestmark = pytest.mark.slow  # DDP ranks



def _launch(exported: Exported, out: Path, policy: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tests.strategies.ddp_nonfinite_run", str(exported.artifacts.directory), str(out),
               f"--policy={policy}"]
    env = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    # NOTE: a rank left waiting in a collective would hang; the timeout turns that into a failure.
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


def test_skip_drops_the_step_on_every_rank_as_torch_without_that_step(mlp_adamw: Exported, tmp_path: Path) -> None:
    result = _launch(mlp_adamw, tmp_path, "skip")
    assert result.returncode == 0, result.stderr[-4000:]
    first, second = ddp_run.load(tmp_path, 0), ddp_run.load(tmp_path, 1)
    for name, value in first["state"].items():
        assert torch.isfinite(value).all(), name
        assert torch.equal(value, second["state"][name]), name
    # plain torch: the two ranks' batches side by side, the poisoned step left out
    reference = mlp_adamw.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=run.LR)
    x, y = run.data()
    size = run.WORLD * run.BATCH
    for step in range(run.STEPS):
        if step == run.POISONED_STEP:
            continue
        F.cross_entropy(reference(x[step * size:(step + 1) * size]), y[step * size:(step + 1) * size]).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(first["state"][name], parameter.detach(), rtol=0, atol=1e-5, msg=name)


def test_raise_stops_every_rank_before_the_update(mlp_adamw: Exported, tmp_path: Path) -> None:
    result = _launch(mlp_adamw, tmp_path, "raise")
    assert result.returncode != 0
    step, errors = run.POISONED_STEP, result.stderr
    assert f"NonFiniteLossError: The training loss is nan at global_step={step} (epoch 0, batch {step})" in errors
    assert f"NonFiniteLossError: The training loss is non-finite on another rank at global_step={step}" in errors
    assert not list(tmp_path.glob("rank*.pt")), "no rank finished the fit"


def test_the_worker_poisons_only_one_rank() -> None:
    x, _ = run.data()
    rows = torch.isnan(x).any(dim=1).nonzero().flatten().tolist()
    assert rows == [(run.POISONED_STEP * run.WORLD + run.POISONED_RANK) * run.BATCH]
