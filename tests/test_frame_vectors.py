"""The frame format's shared vectors (``tests/web/frame_vectors.json``) against ``frames.py``, and the Node side.

``frames.py`` must still write the vectors' train frames byte for byte and read their result
frames (which ``frames.js`` writes byte for byte: ``tests/web/frames.test.mjs``); each train frame
decodes, by the format's own description (header length, header, padding, blobs at their offsets),
to the tensors listed beside it. The slow test runs the JS unit tests (``node --test``).
"""

from __future__ import annotations

import base64
import json
import shutil
import struct
import subprocess

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from ort_lightning.fleet.devices.frames import read_result, unpack  # noqa: E402

from ._web import ROOT  # noqa: E402
from .frame_vectors import PATH, vectors  # noqa: E402

STORED = json.loads(PATH.read_text(encoding="utf-8"))
NUMPY = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.uint8}


def test_frames_py_writes_the_stored_vectors() -> None:
    assert vectors() == STORED, "frames.py's format changed: run python -m tests.frame_vectors, then node --test"


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


@pytest.mark.slow
def test_the_javascript_unit_tests_pass() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed: the JavaScript unit tests need node (20 or newer)")
    tests = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests" / "web").glob("*.test.mjs"))
    run = subprocess.run([node, "--test", *tests], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "# fail 0" in run.stdout
