"""The browser fleet's frame format pinned by shared test vectors (``tests/web/frame_vectors.json``).

``frames.py`` (the server) and ``frames.js`` (the page's and the Node device's codec) implement one
format twice. The vectors are frames that ``frames.py`` writes, with what they hold: the JS tests
(``tests/web/frames.test.mjs``) decode each train frame to those tensors and write each result frame
byte for byte, and ``tests/fleet/devices/test_frame_vectors.py`` checks that ``frames.py`` still writes the train
frames and reads the result frames. SecAgg+ frames too: the server's key stages (``secagg``), its
collect stage (a train frame with ``secagg`` and ``layout``) and a device's answers, whose records are
listed tagged (`tagged`): bytes as ``{"b64": ...}``, an integer beyond 2**53 as ``{"bigint": digits}``.
A change of the format changes the vectors, and both sides' tests follow them.
``python -m tests.fleet.devices.frame_vectors`` rewrites the file.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ort_lightning.fleet.devices.frames import encode_record, pack, record_frame, train_frame
from tests.helpers import ROOT

PATH = ROOT / "tests" / "web" / "frame_vectors.json"


def _tensor(value: torch.Tensor) -> dict[str, Any]:
    kind = {torch.float32: "float32", torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}[value.dtype]
    data = value.to(torch.uint8) if value.dtype == torch.bool else value
    return {"type": kind, "dims": list(value.shape), "data": [str(v) if kind == "int64" else v
                                                              for v in data.flatten().tolist()]}


def _train(message_id: str, server_round: int, weights: np.ndarray, epochs: list[list[list[torch.Tensor]]],
           local: dict[str, int] | None = None) -> dict[str, Any]:
    frame = train_frame(message_id, server_round, weights, epochs, local=local)
    return {"frame": base64.b64encode(frame).decode(), "id": message_id, "round": server_round,
            "weights": weights.tolist(), "local": local,
            "epochs": [[[_tensor(t) for t in batch] for batch in epoch] for epoch in epochs]}


#: A Flower node id beyond 2**53 (Flower's are unsigned 64-bit), which a page's JSON would round.
NODE = 2**63 + 5


def tagged(value: Any) -> Any:
    """A record value as the vectors list it: bytes as ``{"b64": ...}``, an int beyond 2**53 as ``{"bigint": ...}``."""
    if isinstance(value, list):
        return [tagged(item) for item in value]
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, int) and abs(value) >= 2**53:
        return {"bigint": str(value)}
    return value


def untagged(value: Any, *, as_bytes: Callable[[bytes], Any] = bytes) -> Any:
    """A listed value back as Python's: the inverse of `tagged`."""
    if isinstance(value, list):
        return [untagged(item, as_bytes=as_bytes) for item in value]
    if isinstance(value, dict) and "b64" in value:
        return as_bytes(base64.b64decode(value["b64"]))
    if isinstance(value, dict):
        return int(value["bigint"])
    return value


def _b64(frame: bytes) -> str:
    return base64.b64encode(frame).decode()


def _secagg() -> list[dict[str, Any]]:
    """The server's key-stage frames: a share-keys record (public keys by node, in the server's order) and more."""
    share_keys = {"stage": "share_keys", str(NODE): [b"pk1 of the far node", b"pk2 of the far node"],
                  "3": [b"pk1 of node 3", b"pk2"], "clipping_range": 8.0, "sample_num": 3, "mod_range": 2**32,
                  "active_nids": [3, NODE, 2**53 + 1], "note": "neighbours", "raw": bytes([0, 1, 254, 255])}
    unmask = {"stage": "unmask", "active_nids": [NODE], "dead_nids": []}
    stages = (("3-share", 1, NODE, share_keys), ("4-unmask", 2, 3, unmask))
    return [{"frame": _b64(record_frame(message_id, server_round, node, record)), "id": message_id,
             "round": server_round, "node": str(node), "record": [[k, tagged(v)] for k, v in record.items()]}
            for message_id, server_round, node, record in stages]


def _collect(weights: np.ndarray, epochs: list[list[list[torch.Tensor]]]) -> dict[str, Any]:
    """SecAgg+'s collect stage: a train frame with the stage's record and each legacy parameter's place."""
    record = {"stage": "collect_masked_vectors", "ciphertexts": [b"share from 3", b"share from the far node"],
              "srcs": [3, NODE]}
    layout = [[0, 4, [2, 2]], [4, 6, [2]]]
    frame = train_frame("5-collect", 2, weights, epochs, secagg=record, layout=layout)
    return {"frame": _b64(frame), "id": "5-collect", "round": 2, "weights": weights.tolist(), "layout": layout,
            "record": [[k, tagged(v)] for k, v in record.items()]}


def _reply(header: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """A device's secagg frame as ``frames.js``'s recordFrame writes it."""
    blobs: list[np.ndarray] = []
    frame = pack({**header, "record": encode_record(record, blobs)}, blobs)
    return {"frame": _b64(frame), "header": header, "record": [[k, tagged(v)] for k, v in record.items()]}


def _replies() -> list[dict[str, Any]]:
    masked = [np.array([7], np.int64), np.array([[1, 2**40], [3, 2**32 - 1]], np.int64), np.array([0, 5], np.int64)]
    buffers = []
    for array in masked:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        buffers.append(buffer.getvalue())
    counts = {"examples": 3, "steps": 2, "losses": [0.5, 0.25], "seconds": 0.125, "last_epoch_steps": 2}
    return [
        _reply({"type": "secagg", "id": "6-share", "round": 1},
               {"dsts": [NODE, 2**60 + 3], "ciphertexts": [b"to the far node", b"to the other"]}),
        _reply({"type": "secagg", "id": "5-collect", "round": 2, **counts}, {"masked_params": buffers}),
    ]


def vectors() -> dict[str, Any]:
    """The vectors, as ``frames.py`` writes them today."""
    weights = np.array([0.5, -1.25, 3.0, 0.125, -0.0, 1e-7], np.float32)
    features = torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4
    labels = torch.tensor([7, -(2**40)], dtype=torch.int64)
    second = (torch.tensor([[1.5, -2.0, 0.25]]), torch.tensor([3]))
    shipped = [[[features, labels], list(second)], [list(second)]]
    other_types = [[[torch.tensor([[1, -2]], dtype=torch.int32), torch.tensor([True, False, True])]]]
    result_header = {"type": "result", "id": "7-abc", "examples": 3, "steps": 2, "losses": [0.5, 0.25],
                     "seconds": 0.125, "last_epoch_steps": 2, "first_step_seconds": 0.0625, "open_seconds": 0.5}
    trained = np.array([0.25, -0.5, 2.0, 0.0, 1.0, -3.0], np.float32)
    return {
        "train": [
            _train("0-digits", 2, weights, shipped),
            _train("1-types", 1, weights[:2], other_types),
            _train("2-local", 3, weights, [], local={"partition": 1, "partitions": 4, "epochs": 2}),
        ],
        "result": [{"frame": base64.b64encode(pack(result_header, [trained])).decode(), "header": result_header,
                    "weights": trained.tolist()}],
        "secagg": _secagg(),
        "collect": [_collect(weights, [[list(second)]])],
        "reply": _replies(),
    }


def main() -> None:
    """Rewrite the vectors file."""
    PATH.write_text(json.dumps(vectors(), indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
