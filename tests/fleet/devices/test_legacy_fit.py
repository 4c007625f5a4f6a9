"""A fleet's records to Flower's legacy fit records and back: values byte for byte, names, metrics and counts.

A browser's SecAgg+ answers become the records Flower's ``secaggplus_mod`` replies: a key stage's
record as Flower's own client function returns it, and masked vectors as a ``FitRes`` that Flower's
``recorddict_to_fitres`` reads back; anything else is refused in one line.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState, _setup  # noqa: E402
from flwr.common import FitIns, bytes_to_ndarray, ndarray_to_bytes, parameters_to_ndarrays  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from ort_lightning.errors import ConfigurationError, DeviceReplyError  # noqa: E402
from ort_lightning.fleet.devices.legacy_fit import (  # noqa: E402
    NAMES_KEY,
    arrays_to_parameters,
    fit_reply,
    fit_request,
    masked_reply,
    parameters_to_arrays,
    stage_of,
    stage_reply,
)

STAGES = [Stage.SETUP, Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK]


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


# ----------------------------------------------------------------------------- a browser's SecAgg+ answers
@pytest.fixture
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ServerApp's identity, as Flower's own run sets it, for the messages a workflow makes."""
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _asking(stage: str | None) -> Message:
    """A train message as Flower's SecAggPlusWorkflow sends it at `stage` (None: a plain round's)."""
    content = RecordDict() if stage is None else RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage})})
    return Message(content, dst_node_id=5, message_type=MessageType.TRAIN)


@pytest.mark.usefixtures("server_identity")
def test_a_message_tells_its_secagg_stage() -> None:
    assert [stage_of(_asking(stage)) for stage in (None, *STAGES)] == [None, *STAGES]


def _setup_answer() -> dict[str, Any]:
    """Flower's own client answer to the setup stage (``secaggplus_mod``'s ``_setup``)."""
    configs = {Key.SAMPLE_NUMBER: 3, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2, Key.CLIPPING_RANGE: 8.0,
               Key.TARGET_RANGE: 2**22, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: 1000.0}
    return _setup(SecAggPlusState(nid=2**63 + 5), ConfigRecord(configs))


def test_a_key_stages_answer_is_the_record_flowers_workflow_reads() -> None:
    answers = {Stage.SETUP: _setup_answer(),
               Stage.SHARE_KEYS: {Key.DESTINATION_LIST: [2**63 + 5, 7], Key.CIPHERTEXT_LIST: [b"to far", b"to 7"]},
               Stage.UNMASK: {Key.NODE_ID_LIST: [2**63 + 5], Key.SHARE_LIST: [b"share"]}}
    for stage, answer in answers.items():
        content = stage_reply(stage, dict(answer), device="page")
        # what secaggplus_mod replies, and the workflow reads under the same key
        assert content == RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(answer))})
        assert dict(content.config_records[RECORD_KEY_CONFIGS]) == answer
    public = stage_reply(Stage.SETUP, _setup_answer(), device="page").config_records[RECORD_KEY_CONFIGS]
    assert b"BEGIN PUBLIC KEY" in cast(bytes, public[Key.PUBLIC_KEY_1])


@pytest.mark.parametrize(("stage", "answer", "message"), [
    (Stage.SETUP, {Key.PUBLIC_KEY_1: b"pk1"}, r"page answered SecAgg\+'s setup stage with \['pk1'\], but \['pk1', "
                                              r"'pk2'\] were expected; the device is refused \(use the fleet's page\)"),
    (Stage.SETUP, {Key.PUBLIC_KEY_1: b"pk1", Key.PUBLIC_KEY_2: b"pk2", "weights": [0.5]},
     r"page answered SecAgg\+'s setup stage with \['pk1', 'pk2', 'weights'\], but \['pk1', 'pk2'\] were expected"),
    (Stage.SETUP, {Key.PUBLIC_KEY_1: "pk1", Key.PUBLIC_KEY_2: b"pk2"},
     r"page sent pk1 of SecAgg\+'s setup stage as pk1, but bytes was expected; the device is refused"),
    (Stage.SHARE_KEYS, {Key.DESTINATION_LIST: 7, Key.CIPHERTEXT_LIST: [b"c"]},
     r"page sent dsts of SecAgg\+'s share_keys stage as 7, but a list of int was expected"),
    (Stage.UNMASK, {Key.NODE_ID_LIST: [True], Key.SHARE_LIST: [b"s"]},
     r"page sent nids of SecAgg\+'s unmask stage as \[True\], but a list of int was expected"),
], ids=["a-key-missing", "a-key-more", "a-string-for-bytes", "an-int-for-a-list", "a-bool-for-an-int"])
def test_a_key_stages_answer_of_other_keys_or_kinds_is_refused(stage: str, answer: dict[str, Any],
                                                               message: str) -> None:
    with pytest.raises(DeviceReplyError, match=message):
        stage_reply(stage, answer, device="page")


def _npy(array: np.ndarray) -> bytes:
    return ndarray_to_bytes(array)


SHAPES = [(2, 3), (3,)]


def test_masked_vectors_are_a_fitres_without_weights_that_flower_reads_back() -> None:
    vectors = [_npy(np.array([12], np.int64)), _npy(np.arange(6, dtype=np.int64).reshape(2, 3)),
               _npy(np.array([2**31, 0, 1], np.int64))]
    metrics = {"num-examples": 37, "train_loss": 0.25, "steps": 3}
    content = masked_reply({Key.MASKED_PARAMETERS: vectors}, SHAPES, 37, metrics, device="page")
    fitres = compat.recorddict_to_fitres(content, keep_input=True)
    assert (fitres.num_examples, fitres.metrics, fitres.parameters.tensors) == (37, metrics, [])
    # what SecAggPlusWorkflow sums: the vectors as sent, each an int64 array of its parameter's shape
    sent = cast(list[bytes], content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])
    assert sent == vectors
    assert [bytes_to_ndarray(v).shape for v in sent] == [(1,), *SHAPES]


@pytest.mark.parametrize(("vectors", "message"), [
    ([np.array([1]), np.zeros((3, 2), np.int64), np.zeros(3, np.int64)],
     r"page sent masked vectors of \[\('int64', \(1,\)\), \('int64', \(3, 2\)\), \('int64', \(3,\)\)\], but int64 "
     r"arrays of shapes \[\(1,\), \(2, 3\), \(3,\)\] were expected; the device is refused \(use the fleet's page\)"),
    ([np.array([1]), np.zeros((2, 3), np.float64), np.zeros(3, np.int64)],
     r"page sent masked vectors of \[\('int64', \(1,\)\), \('float64', \(2, 3\)\), "),
    ([np.array([1]), np.zeros((2, 3), np.int64)], r"page sent masked vectors of \[\('int64', \(1,\)\), \('int64', "
                                                   r"\(2, 3\)\)\], but int64 arrays of shapes \[\(1,\), \(2, 3\), "),
    ([b"\x93NUMPY cut"], r"page sent masked vectors that are not \.npy bytes \(.+\); the device is refused"),
], ids=["a-shape-transposed", "floats", "one-vector-short", "not-npy"])
def test_masked_vectors_of_another_count_type_or_shape_are_refused(vectors: list[Any], message: str) -> None:
    sent = [v if isinstance(v, bytes) else _npy(v.astype(np.int64) if v.dtype.kind == "i" else v) for v in vectors]
    with pytest.raises(DeviceReplyError, match=message):
        masked_reply({Key.MASKED_PARAMETERS: sent}, SHAPES, 37, {}, device="page")
