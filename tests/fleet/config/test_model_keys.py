"""The ``model`` keys of a language model: its own loss takes its labels as an input."""

from __future__ import annotations

import pytest

from ort_lightning.errors import ConfigurationError

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from ort_lightning.fleet import FleetConfig  # noqa: E402


def test_a_models_own_loss_takes_its_example_input_from_the_data() -> None:
    config = FleetConfig.from_dict({"model": {"factory": "m:f", "loss": None, "input_names": ["input_ids", "labels"]},
                                    "data": {"partition": "ordered"}, "output": {"pretrained": True}})
    assert (config.model.loss, config.data.partition, config.output.pretrained) == (None, "ordered", True)
    with pytest.raises(ConfigurationError, match=r"Expected `model.input_shape` null with `model.loss: null` \(the "
                                                 r"model's own loss\), but got \[2, 8\]"):
        FleetConfig.from_dict({"model": {"factory": "m:f", "loss": None, "input_shape": [2, 8]}})
