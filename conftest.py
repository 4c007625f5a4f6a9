"""Doctest collection of the package; a core per test worker; the `alone` and `spread` markers; slow files first.

`slow` is registered in pyproject.toml; `alone` and `spread` are about how .ci/run shares the machine.
"""

import importlib.util
import os
from collections.abc import Iterator

import pytest

# NOTE: without Flower, importing ort_lightning.fleet raises on purpose; its doctests are skipped, as
# tests/fleet/test_fleet.py is, instead of failing collection.
collect_ignore = [] if importlib.util.find_spec("flwr") else ["ort_lightning/fleet"]

#: The cores this process found when it started, before ``--core-per-worker`` pinned it to one of them.
MACHINE_CORES = frozenset(os.sched_getaffinity(0))
#: Set by the main pytest process under ``--core-per-worker`` for the pytest-xdist workers it starts.
CORE_PER_WORKER = "ORT_LIGHTNING_TESTS_CORE_PER_WORKER"


def _pin_this_worker() -> None:
    """Under ``--core-per-worker``, pin this pytest-xdist worker (worker i to the i-th core, round robin)."""
    # NOTE: ORT's intra-op pool and torch's OpenMP threads spin after their last kernel. With several test
    # processes on 2 cores, each one's pools over both cores take CPU from the others (the fast tier measured
    # 252 s of CPU on two cores against 139 s on one). ORT's pool is sized from this affinity by the thread
    # policy, torch's at its first use: hence here, as the worker imports this file, before tests/conftest.py
    # imports torch. The processes a test starts inherit the core.
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw3"
    if worker and os.environ.get(CORE_PER_WORKER):
        cores = sorted(MACHINE_CORES)
        os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})


_pin_this_worker()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--core-per-worker``: each pytest-xdist worker (and every process it starts) runs on one core."""
    parser.addoption(
        "--core-per-worker", action="store_true",
        help="pin each pytest-xdist worker, and the processes it starts, to one core (worker i to the i-th core, "
             "round robin); tests marked `alone` need the machine to themselves and must run without it",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register `alone` and `spread`; under ``--core-per-worker``, tell the workers to pin themselves."""
    # NOTE: a test that decides by measured wall time, checks the thread pools across several cores, or starts
    # Ray (beside the other tests on a loaded machine, a Ray round hung past its 300 s limit) needs the machine
    # to itself: .ci/run runs these alone and unpinned, after the rest.
    config.addinivalue_line(
        "markers", "alone: needs the machine to itself (measured wall time, thread pools across cores, Ray); "
                   ".ci/run runs these one at a time, last")
    config.addinivalue_line(
        "markers", "spread: starts a group of processes (a Flower deployment, browsers, Node devices) that a "
                   "pinned worker lets run on every core")
    if config.getoption("core_per_worker") and not hasattr(config, "workerinput"):
        os.environ[CORE_PER_WORKER] = "1"  # the workers start after this hook, with this environment


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """A `spread` test runs on every core, also under ``--core-per-worker``; its processes inherit that."""
    # NOTE: a group of processes on one core waits on itself: a Flower deployment took 116 s pinned against 48 s.
    pinned = os.sched_getaffinity(0)
    if item.get_closest_marker("spread"):
        os.sched_setaffinity(0, MACHINE_CORES)
    try:
        return (yield)
    finally:
        os.sched_setaffinity(0, pinned)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with `slow` tests first, so that a pytest-xdist run does not end on a long file.

    With ``pytest -n N --dist loadfile --no-loadscope-reorder`` pytest-xdist hands out files in this order
    (its default order, most tests first, left the single long tests for the end).
    """
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the files keep their order, a file its tests'
