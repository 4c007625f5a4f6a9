"""``python -m benchmarks.secagg`` runs in Node on a small update, so that it cannot rot (no timing assertions)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.secagg import in_node, table


@pytest.mark.slow  # a Node child process
@pytest.mark.skipif(shutil.which("node") is None, reason="node (Node.js 20) is not installed (.ci/run installs it)")
def test_the_secagg_cost_runs_in_node_and_counts_flowers_bytes() -> None:
    (row,) = in_node({"sizes": [1000], "devices": 3, "repeats": 1})
    # Two int64 .npy arrays (the weight, then the update), each behind numpy's 128-byte header.
    assert row["sent"]["masked"] == 2 * 128 + 8 * (1 + 1000)
    assert row["sent"]["plain"] == 4 * 1000
    assert all(row[stage] >= 0 for stage in ("setup", "share_keys", "collect", "unmask"))
    assert "| Node | 1,000 |" in table({"Node": [row]})
