"""The multi-node recipe of docs/guide/ddp.md, on loopback: two torchrun "nodes" of one process each (gloo, "ort_ddp").

With static rendezvous (``--rdzv-backend=static`` and ``--master-addr/--master-port``),
``--node-rank`` decides the ranks: node 0 holds global rank 0 and writes the checkpoints.
(With c10d rendezvous torchrun ignores ``--node-rank`` and ranks follow the order of arrival.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import Exported
from tests.helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spread]  # DDP ranks on two nodes



def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_static_rendezvous_gives_node_rank_zero_global_rank_zero(mlp_adamw: Exported, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # NOTE: node 1 starts first, so that arrival order alone would make it rank 0.
    nodes = {}
    for node in (1, 0):
        command = [str(torchrun), "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
                   "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}",
                   "-m", "tests.strategies.multinode_worker", str(mlp_adamw.artifacts.directory),
                   str(tmp_path / f"node{node}")]
        nodes[node] = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    for node, process in nodes.items():
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 0, f"node {node}:\n{output[-3000:]}"
    for node in (0, 1):
        ranks = json.loads((tmp_path / f"node{node}" / "rank.json").read_text())
        assert ranks == {"global_rank": node, "node_rank": node, "local_rank": 0, "world_size": 2}
    assert (tmp_path / "node0" / "checkpoints" / "last.ortckpt").is_file()
    assert not list((tmp_path / "node1" / "checkpoints").glob("*.ortckpt"))
    first, second = (torch.load(tmp_path / f"node{node}" / "state.pt") for node in (0, 1))
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)
