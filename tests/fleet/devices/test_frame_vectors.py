"""The frame format's shared vectors (``tests/web/frame_vectors.json``) against ``frames.py``, and the Node side.

``frames.py`` must still write the vectors' train frames byte for byte and read their result
frames (which ``frames.js`` writes byte for byte: ``tests/web/frames.test.mjs``); each train frame
decodes, by the format's own description (header length, header, padding, blobs at their offsets),
to the tensors listed beside it. SecAgg+'s frames decode to the records listed beside them, and a
record that is not what ``encode_record`` writes is refused in one line. The slow test runs the JS
unit tests (``node --test``).
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.common import bytes_to_ndarray  # noqa: E402

from ort_lightning.errors import DeviceReplyError  # noqa: E402
from ort_lightning.fleet.devices.frames import decode_record, read_counts, read_result, unpack  # noqa: E402
from tests._web import ROOT  # noqa: E402
from tests.fleet.devices.frame_vectors import NODE, PATH, untagged, vectors  # noqa: E402

STORED = json.loads(PATH.read_text(encoding="utf-8"))
NUMPY = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.uint8}


def test_frames_py_writes_the_stored_vectors() -> None:
    assert vectors() == STORED, (
        "frames.py's format changed: run python -m tests.fleet.devices.frame_vectors, then node --test")


@pytest.mark.parametrize("vector", STORED["train"], ids=lambda v: v["id"])
def test_a_train_frame_decodes_by_the_formats_description(vector: dict) -> None:
    frame = base64.b64decode(vector["frame"])
    (length,) = struct.unpack_from("<I", frame)
    header = json.loads(frame[4 : 4 + length])
    start = -(-(4 + length) // 8) * 8
    assert frame[4 + length : start] == b"\0" * (start - 4 - length)
    blobs = header.get("blobs", [[0, len(frame) - start]])
    assert all(offset % 8 == 0 for offset, _ in blobs)

    def blob(index: int, kind: type) -> np.ndarray:
        offset, size = blobs[index]
        return np.frombuffer(frame, dtype=np.dtype(kind).newbyteorder("<"), count=size // np.dtype(kind).itemsize,
                             offset=start + offset)

    assert (header["id"], header["round"], header.get("local")) == (vector["id"], vector["round"], vector["local"])
    np.testing.assert_array_equal(blob(header["weights"], np.float32), np.array(vector["weights"], np.float32))
    for epoch, listed_epoch in zip(header["epochs"], vector["epochs"], strict=True):
        for batch, listed_batch in zip(epoch, listed_epoch, strict=True):
            for tensor, listed in zip(batch, listed_batch, strict=True):
                assert (tensor["type"], tensor["dims"]) == (listed["type"], listed["dims"])
                values = np.array([int(v) for v in listed["data"]] if listed["type"] == "int64" else listed["data"])
                np.testing.assert_array_equal(blob(tensor["blob"], NUMPY[tensor["type"]]), values)


@pytest.mark.parametrize("vector", STORED["result"], ids=lambda v: v["header"]["id"])
def test_a_result_frame_as_the_page_writes_it_reads_back_in_python(vector: dict) -> None:
    header, payload = unpack(base64.b64decode(vector["frame"]))
    assert header == vector["header"]
    result = read_result(header, payload, device="page", parameters=len(vector["weights"]),
                         given=vector["header"]["examples"])
    np.testing.assert_array_equal(result.weights, np.array(vector["weights"], np.float32))
    assert (result.examples, result.steps, result.losses, result.last_epoch_steps) == (3, 2, [0.5, 0.25], 2)


def _record(listed: list[list[Any]]) -> dict[str, Any]:
    return {key: untagged(value) for key, value in listed}


@pytest.mark.parametrize("vector", STORED["secagg"], ids=lambda v: v["id"])
def test_a_secagg_frame_of_the_server_decodes_to_its_record_in_the_servers_key_order(vector: dict) -> None:
    header, payload = unpack(base64.b64decode(vector["frame"]))
    assert (header["type"], header["id"], header["round"], header["node"]) == (
        "secagg", vector["id"], vector["round"], vector["node"])
    record = decode_record(header["record"], payload, header.get("blobs"), device="server")
    assert list(record.items()) == list(_record(vector["record"]).items())


def test_the_far_node_id_travels_as_digits_and_comes_back_exactly() -> None:
    [share_keys, _] = STORED["secagg"]
    header, payload = unpack(base64.b64decode(share_keys["frame"]))
    assert header["node"] == str(NODE)
    assert ["active_nids", [3, {"int": str(NODE)}, {"int": str(2**53 + 1)}]] in header["record"]
    record = decode_record(header["record"], payload, header.get("blobs"), device="server")
    assert record["active_nids"] == [3, NODE, 2**53 + 1]
    assert list(record)[:3] == ["stage", str(NODE), "3"]  # a page's JSON object would put "3" first


@pytest.mark.parametrize("vector", STORED["collect"], ids=lambda v: v["id"])
def test_the_collect_stage_is_a_train_frame_with_the_stages_record_and_the_layout(vector: dict) -> None:
    header, payload = unpack(base64.b64decode(vector["frame"]))
    assert (header["type"], header["id"], header["layout"]) == ("train", vector["id"], vector["layout"])
    record = decode_record(header["secagg"], payload, header["blobs"], device="server")
    assert record == _record(vector["record"])
    at, size = header["blobs"][header["weights"]]
    weights = np.frombuffer(payload[at : at + size], np.float32)
    np.testing.assert_array_equal(weights, np.array(vector["weights"], np.float32))
    assert [list(weights[start:end].reshape(shape).shape) for start, end, shape in header["layout"]] == [[2, 2], [2]]


@pytest.mark.parametrize("vector", STORED["reply"], ids=lambda v: v["header"]["id"])
def test_a_devices_secagg_frame_as_the_page_writes_it_reads_back_in_python(vector: dict) -> None:
    header, payload = unpack(base64.b64decode(vector["frame"]))
    assert {k: v for k, v in header.items() if k not in ("record", "blobs")} == vector["header"]
    record = decode_record(header["record"], payload, header.get("blobs"), device="page")
    assert record == _record(vector["record"])
    if "examples" in header:
        assert read_counts(header, device="page", given=3) == (3, 2, [0.5, 0.25], 2)
        assert [bytes_to_ndarray(v).tolist() for v in record["masked_params"]] == [
            [7], [[1, 2**40], [3, 2**32 - 1]], [0, 5]]


@pytest.mark.parametrize(("record", "blobs", "message"), [
    ({"stage": "setup"}, None, r"d sent a SecAgg\+ record that is \{'stage': 'setup'\}, not a list of \[key, value\] "
                               r"pairs; use the fleet's page\."),
    ([["pk1"]], None, r"d sent a SecAgg\+ record that is \[\['pk1'\]\], not a list of \[key, value\] pairs"),
    ([["pk1", {"bytes": 2}]], [[0, 4], [8, 4]], r"d sent a record naming blob 2, but its frame holds 2; use the "
                                                r"fleet's page\."),
    ([["pk1", {"bytes": True}]], None, r"d sent a record naming blob True, but its frame holds 1"),
    ([["pk1", {"bytes": 1}]], [[0, 4], [8, 9]], r"d sent a frame whose blob 1 ends past its payload; use the "
                                                r"fleet's page\."),
    ([["pk1", {"bytes": 0}]], [[0], [8, 4]], r"d sent a frame whose blob 0 is \[0\], not \[offset, nbytes\]; use the "
                                             r"fleet's page\."),
    ([["pk1", {"bytes": 0}]], [[-8, 8], [8, 4]], r"d sent a frame whose blob 0 is \[-8, 8\], not \[offset, nbytes\]"),
    ([["dsts", [{"int": "12ab"}]]], None, r"d sent a record value \{'int': '12ab'\}, but a number, a string, "
                                          r"\{\"bytes\": blob\} or \{\"int\": digits\} was expected; use the "
                                          r"fleet's page\."),
    ([["pk1", {"bytes": 0, "extra": 1}]], None, r"d sent a record value \{'bytes': 0, 'extra': 1\}, but a number"),
], ids=["an-object", "not-a-pair", "blob-beyond-the-list", "blob-not-an-index", "blob-past-the-payload",
        "blob-not-a-pair", "blob-at-a-negative-offset", "int-not-digits", "bytes-with-more-keys"])
def test_a_record_that_is_not_what_encode_record_writes_is_refused(record: object, blobs: object,
                                                                    message: str) -> None:
    with pytest.raises(DeviceReplyError, match=message):
        decode_record(record, memoryview(bytes(16)), blobs, device="d")


@pytest.mark.slow
def test_the_javascript_unit_tests_pass() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed: the JavaScript unit tests need node (20 or newer)")
    tests = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "web").glob("*.test.mjs"))
    run = subprocess.run([node, "--test", *tests], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout
