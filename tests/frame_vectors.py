"""The browser fleet's frame format pinned by shared test vectors (``tests/web/frame_vectors.json``).

``frames.py`` (the server) and ``frames.js`` (the page's and the Node device's codec) implement one
format twice. The vectors are frames that ``frames.py`` writes, with what they hold: the JS tests
(``tests/web/frames.test.mjs``) decode each train frame to those tensors and write each result frame
byte for byte, and ``tests/test_frame_vectors.py`` checks that ``frames.py`` still writes the train
frames and reads the result frames. A change of the format changes the vectors, and both sides'
tests follow them. ``python -m tests.frame_vectors`` rewrites the file.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ort_lightning.fleet.devices.frames import pack, train_frame

PATH = Path(__file__).resolve().parent / "web" / "frame_vectors.json"


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
    }


def main() -> None:
    """Rewrite the vectors file."""
    PATH.write_text(json.dumps(vectors(), indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
