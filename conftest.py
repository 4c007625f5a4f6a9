"""Doctest collection of the package: ort_lightning.fleet needs the optional `fleet` extra (Flower)."""

import importlib.util

# NOTE: without Flower, importing ort_lightning.fleet raises on purpose; its doctests are skipped, as
# tests/test_fleet.py is, instead of failing collection.
collect_ignore = [] if importlib.util.find_spec("flwr") else ["ort_lightning/fleet"]
