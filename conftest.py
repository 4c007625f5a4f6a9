"""Doctest collection of the package: ort_lightning.fleet needs the optional `fleet` extra (Flower); markers.

`slow` is registered in pyproject.toml. `timing` is .ci/run's business: which lane runs a test.
"""

import importlib.util

import pytest

# NOTE: without Flower, importing ort_lightning.fleet raises on purpose; its doctests are skipped, as
# tests/test_fleet.py is, instead of failing collection.
collect_ignore = [] if importlib.util.find_spec("flwr") else ["ort_lightning/fleet"]


def pytest_configure(config: pytest.Config) -> None:
    """Register `timing`, the marker that only .ci/run reads."""
    # NOTE: a test that decides by measured wall time fails when other processes share the cores; .ci/run runs
    # these alone, after the fast and slow lanes (which run side by side), and the fast tier runs them as usual.
    config.addinivalue_line("markers", "timing: decides by measured wall time; .ci/run runs these alone, last")
