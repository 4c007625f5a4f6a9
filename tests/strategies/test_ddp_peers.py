"""A rank of a 2-rank gloo ``ort_ddp`` run dies: its peer ends at once, with one line that names it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ort_lightning.errors import DistributedError
from ort_lightning.strategies.peers import lost_rank
from tests.conftest import Exported
from tests.helpers import ROOT, RunIf

pytestmark = pytest.mark.slow  # DDP ranks, one of them lost



@RunIf(linux=True)  # kills a rank with SIGKILL
@pytest.mark.parametrize("dead", [1, 0], ids=["child-rank-dies", "launching-rank-dies"])
def test_the_peer_of_a_dead_rank_ends_with_one_line_naming_it(mlp_adamw: Exported, tmp_path: Path, dead: int) -> None:
    command = [sys.executable, "-m", "tests.strategies.ddp_peer_lost_run", str(mlp_adamw.artifacts.directory),
               str(tmp_path), f"--dead-rank={dead}"]
    # NOTE: the output pipes close when the last rank exits, so this waits for the survivor too
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    ended = time.time()
    assert result.returncode != 0
    survivor = 1 - dead
    errors = [line for line in result.stderr.splitlines() if "Error" in line]
    assert errors == [line for line in errors if line.startswith("DistributedError: ")], result.stderr[-3000:]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.match(rf"DistributedError: Rank {dead} of 2 is gone: rank {survivor} lost its connection to it in .* "
                    r"at global_step=3 .*start the run again from its last checkpoint", errors[0]), errors[0]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert ended - float((tmp_path / "died").read_text()) < 30


def test_only_a_lost_peer_becomes_a_distributed_error() -> None:
    lost = lost_rank(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:44185: Connection reset by peer."),
                     rank=2, world_size=4, where="a barrier")
    assert isinstance(lost, DistributedError)
    assert re.match(r"One of ranks \[0, 1, 3\] is gone: rank 2 lost its connection to it in a barrier "
                    r"\(Read error\)", str(lost)), str(lost)
    hung = lost_rank(RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation to complete"),
                     rank=0, world_size=2, where="the gradient all-reduce")
    assert re.match(r"Rank 1 of 2 is gone: rank 0 waited in vain for it in the gradient all-reduce", str(hung))
    # a collective that fails for another reason keeps torch's own error
    assert lost_rank(RuntimeError("Tensors must be contiguous"), rank=0, world_size=2, where="a broadcast") is None
