"""A fleet's records to Flower's legacy fit records and back: values byte for byte, names, metrics and counts."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.common import FitIns, parameters_to_ndarrays  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402

from ort_lightning.errors import ConfigurationError  # noqa: E402
from ort_lightning.fleet.devices.legacy_fit import (  # noqa: E402
    NAMES_KEY,
    arrays_to_parameters,
    fit_reply,
    fit_request,
    parameters_to_arrays,
)


def _record() -> ArrayRecord:
    rng = np.random.default_rng(3)
    return ArrayRecord({"net.0.weight": Array(rng.normal(size=(4, 3)).astype(np.float32)),
                        "net.0.bias": Array(rng.normal(size=(4,)).astype(np.float32)),
                        "bn.num_batches_tracked": Array(np.array(7, dtype=np.int64))})


def test_arrays_become_legacy_parameters_and_come_back_exactly() -> None:
    record = _record()
    parameters, names = arrays_to_parameters(record)
    assert names == ["net.0.weight", "net.0.bias", "bn.num_batches_tracked"]
    assert parameters.tensors == [record[name].data for name in names]  # the .npy bytes, untouched
    back = parameters_to_arrays(parameters, names)
    assert list(back) == names
    for name in names:
        original, returned = record[name].numpy(), back[name].numpy()
        assert returned.dtype == original.dtype
        assert returned.shape == original.shape
        assert returned.tobytes() == original.tobytes()


def test_a_fit_instruction_and_its_reply_cross_the_edge_with_names_metrics_and_count() -> None:
    record = _record()
    parameters, names = arrays_to_parameters(record)
    instruction = compat.fitins_to_recorddict(FitIns(parameters, {"lr-scale": 0.5, NAMES_KEY: "\n".join(names)}), True)
    request = fit_request(instruction)
    assert list(request.array_records["arrays"]) == names
    assert dict(request.config_records["config"]) == {"lr-scale": 0.5}
    metrics = {"num-examples": 37, "train_loss": 0.25, "steps": 3}
    reply = fit_reply(RecordDict({"arrays": request.array_records["arrays"], "metrics": MetricRecord(metrics)}))
    fitres = compat.recorddict_to_fitres(reply, keep_input=True)
    assert fitres.num_examples == 37
    assert fitres.metrics == metrics
    for got, name in zip(parameters_to_ndarrays(fitres.parameters), names, strict=True):
        assert got.tobytes() == record[name].numpy().tobytes()


def test_names_that_do_not_match_the_tensors_are_named() -> None:
    parameters, _ = arrays_to_parameters(_record())
    with pytest.raises(ConfigurationError, match="Expected one name per legacy tensor, but got 2 names for 3"):
        parameters_to_arrays(parameters, ["a", "b"])
