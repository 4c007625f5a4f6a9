"""``python -m benchmarks.secagg_python`` runs on a small update, so that it cannot rot (no timing assertions)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from benchmarks.secagg_python import STAGES, measure, table  # noqa: E402


def test_the_python_secagg_cost_runs_flowers_mod_and_counts_its_bytes() -> None:
    row = measure(1000, 3, 1)
    # The same bytes as the JavaScript device's: two int64 .npy arrays (the weight, then the update).
    assert row["sent"]["collect_masked_vectors"] == 2 * 128 + 8 * (1 + 1000)
    assert all(row[stage] >= 0 for stage in STAGES)
    assert "| Python (Flower's `secaggplus_mod`) | 1,000 |" in table([row])
