"""SecAgg+'s golden vectors (``tests/web/secagg_vectors.json``) are what Flower writes today.

``tests/web/secagg.test.mjs`` holds the JavaScript client to these vectors byte for byte; this test
holds the vectors to Flower, so that a Flower release that changes a primitive (its mask generator,
its Shamir, its key format) fails here, naming the version the vectors were pinned to.
"""

from __future__ import annotations

import json

import pytest

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from tests.fleet.devices.secagg_vectors import FLOWER, PATH, vectors  # noqa: E402

STORED = json.loads(PATH.read_text(encoding="utf-8"))


def test_the_vectors_are_pinned_to_the_installed_flower() -> None:
    assert STORED["flwr"] == FLOWER == flwr.__version__, (
        f"the SecAgg+ vectors were made with flwr {STORED['flwr']} (pinned: {FLOWER}), but flwr {flwr.__version__} is "
        "installed: rewrite them with python -m tests.fleet.devices.secagg_vectors, run node --test "
        "tests/web/secagg.test.mjs, and move the pin once the JavaScript client matches")


def test_flower_still_writes_the_stored_vectors() -> None:
    fresh = vectors()
    changed = sorted(key for key in STORED if fresh.get(key) != STORED[key])
    assert not changed, (
        f"Flower {flwr.__version__} no longer writes the SecAgg+ vectors {changed} that flwr {FLOWER} wrote: the "
        "JavaScript client (ort_lightning/fleet/devices/web/secagg*.js) must follow; rewrite the vectors with "
        "python -m tests.fleet.devices.secagg_vectors and run node --test tests/web/secagg.test.mjs")
