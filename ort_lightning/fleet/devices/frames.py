"""The frames a web device and the fleet's server exchange over the page's one WebSocket.

Text frames are JSON objects; binary frames (``train``, ``result``) are a JSON header and aligned blobs of
tensors. The message types are ``ort_lightning/web/wire.json``'s; the layout and each frame's keys are in
docs/browsers.md ("The wire"), and ``frames.js`` is the device's side. `read_result` checks a result before
it becomes a reply to the strategy.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ort_lightning.errors import BatchError, DeviceReplyError

__all__ = ["HEADER_LIMIT", "TYPES", "Result", "decode_record", "encode_record", "pack", "read_counts", "read_result",
           "record_frame", "train_frame", "unpack"]

#: onnxruntime-web's tensor type names of the dtypes a batch may hold.
TYPES = {torch.float32: "float32", torch.int64: "int64", torch.int32: "int32", torch.bool: "bool"}
#: The largest JSON header a page may send (the losses of a round are its bulk).
HEADER_LIMIT = 1 << 20
_LENGTH = struct.Struct("<I")
_ALIGN = 8
#: The largest integer a page's JSON reads exactly (2**53 - 1): a larger one, a 64-bit node id, travels as a string.
_EXACT = (1 << 53) - 1


@dataclass(frozen=True)
class Result:
    """A device's checked answer to a train frame.

    Attributes:
        weights: every parameter, flat float32, in the training graph's order.
        examples: the examples of one epoch (FedAvg's weight).
        steps: optimizer steps the device ran in the round.
        losses: the training loss of each step.
    """

    weights: np.ndarray
    examples: int
    steps: int
    losses: list[float]
    #: Steps of the last local epoch, as the device counted them (None when it did not say).
    last_epoch_steps: int | None = None


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def pack(header: dict[str, Any], blobs: Sequence[np.ndarray]) -> bytes:
    """One binary frame: `header` (plus the blobs' offsets, for more than one blob) and the blobs' bytes."""
    offsets, offset = [], 0
    for blob in blobs:
        offsets.append([offset, blob.nbytes])
        offset = _padded(offset + blob.nbytes)
    if len(blobs) > 1:
        header = {**header, "blobs": offsets}
    text = json.dumps(header, separators=(",", ":")).encode()
    start = _padded(_LENGTH.size + len(text))
    end = offsets[-1][0] + offsets[-1][1] if offsets else 0
    frame = bytearray(start + end)
    frame[: _LENGTH.size] = _LENGTH.pack(len(text))
    frame[_LENGTH.size : _LENGTH.size + len(text)] = text
    for blob, (at, size) in zip(blobs, offsets, strict=True):
        frame[start + at : start + at + size] = np.ascontiguousarray(blob).tobytes()
    return bytes(frame)


def unpack(frame: bytes, *, device: str = "the device") -> tuple[dict[str, Any], memoryview]:
    """The header and the payload of a binary frame.

    Raises:
        DeviceReplyError: for a frame too short, a header over `HEADER_LIMIT` or not a JSON object.
    """
    if len(frame) < _LENGTH.size:
        raise DeviceReplyError(f"{device} sent a binary frame of {len(frame)} bytes, shorter than its 4-byte header "
                               "length; use the fleet's page (page.js), which writes result frames.")
    (length,) = _LENGTH.unpack_from(frame)
    room = min(HEADER_LIMIT, len(frame) - _LENGTH.size)
    if length > room:
        raise DeviceReplyError(f"{device} sent a frame whose header claims {length} bytes, but at most {room} are "
                               "allowed there; use the fleet's page.")
    try:
        header = json.loads(bytes(frame[_LENGTH.size : _LENGTH.size + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DeviceReplyError(
            f"{device} sent a frame header that is not JSON ({error}); use the fleet's page."
        ) from None
    if not isinstance(header, dict):
        raise DeviceReplyError(f"{device} sent a frame header that is a {type(header).__name__}, not a JSON object; "
                               "use the fleet's page.")
    return header, memoryview(frame)[_padded(_LENGTH.size + length) :]


def _tensor(tensor: object, blobs: list[np.ndarray]) -> dict[str, Any]:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in TYPES:
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise BatchError(f"A browser device takes tensors of dtype {sorted(map(str, TYPES.values()))}, but a batch "
                         f"holds {kind}; convert it in your Dataset or collate_fn (tensor.to(torch.float32)).")
    array = tensor.detach().cpu().contiguous().numpy()
    blobs.append(array.view(np.uint8) if array.dtype == np.bool_ else array)
    return {"type": TYPES[tensor.dtype], "dims": list(array.shape), "blob": len(blobs) - 1}


def train_frame(
    message_id: str,
    server_round: int,
    weights: np.ndarray,
    epochs: Sequence[Sequence[Sequence[torch.Tensor]]],
    *,
    local: dict[str, int] | None = None,
    clip: float | None = None,
    secagg: dict[str, Any] | None = None,
    layout: list[list[Any]] | None = None,
) -> bytes:
    """The train frame of one round: the weights and each epoch's batches, in the order the device trains them.

    The header's ``"examples"`` is the first epoch's examples (the first dimension of each batch's first tensor).
    With `local` (``{"partition", "partitions", "epochs"}``) the frame carries no batches: the page
    makes its own with the fleet's data module, ``epochs`` times. With `clip` (``"clip"``, Flower's
    client-side fixed clipping), the device scales its update (trained minus sent weights) down to at
    most that L2 norm over all values, and says the norm it had (``"update_norm"``). With `secagg` (the
    SecAgg+ collect stage's record, see `encode_record`) and `layout` (``[start, end, shape]`` of each
    legacy parameter in the weights, in the order Flower sums them), the device masks its trained
    values and replies a ``secagg`` frame instead of a result: its weights never travel.

    Raises:
        BatchError: for a batch tensor of a dtype onnxruntime-web does not take.
    """
    blobs: list[np.ndarray] = [np.ascontiguousarray(weights, dtype=np.float32)]
    batches = [[[_tensor(tensor, blobs) for tensor in batch] for batch in epoch] for epoch in epochs]
    examples = sum(int(batch[0]["dims"][0]) for batch in batches[0]) if batches else 0
    header = {"type": "train", "id": message_id, "round": server_round, "weights": 0, "epochs": batches,
              "examples": examples}
    if local is not None:
        header["local"] = local
    if clip is not None:
        header["clip"] = clip
    if secagg is not None:
        header["secagg"] = encode_record(secagg, blobs)
        header["layout"] = layout or []
    return pack(header, blobs)


def encode_record(record: dict[str, Any], blobs: list[np.ndarray]) -> list[list[Any]]:
    """A SecAgg+ config record as JSON ``[key, value]`` pairs: bytes as ``{"bytes": blob}`` (appended to `blobs`).

    Values are Flower's ``ConfigRecord`` values: numbers, strings, bytes and lists of them. An integer
    beyond JSON's exact range in a page (a 64-bit node id) is ``{"int": "<digits>"}``. Pairs, not an
    object, since a page's JSON reorders integer-like keys, and a node's Shamir share follows its key's place.
    """
    def encode(value: Any) -> Any:
        if isinstance(value, list):
            return [encode(item) for item in value]
        if isinstance(value, bytes):
            blobs.append(np.frombuffer(value, np.uint8))
            return {"bytes": len(blobs) - 1}
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _EXACT:
            return {"int": str(value)}
        return value

    return [[key, encode(value)] for key, value in record.items()]


def decode_record(encoded: object, payload: memoryview, blobs: object, *, device: str) -> dict[str, Any]:
    """The record `encode_record` wrote (the device's side writes the same), its bytes read from `payload`.

    Raises:
        DeviceReplyError: for a record that is not a list of pairs, a value of another shape, or a blob it names
            that the frame lacks or places outside its payload.
    """
    spans = blobs if isinstance(blobs, list) else [[0, payload.nbytes]]

    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(item) for item in value]
        if isinstance(value, dict) and set(value) == {"int"} and str(value["int"]).lstrip("-").isdigit():
            return int(value["int"])
        if isinstance(value, dict) and set(value) == {"bytes"}:
            index = value["bytes"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(spans):
                raise DeviceReplyError(f"{device} sent a record naming blob {index!r}, but its frame holds "
                                       f"{len(spans)}; use the fleet's page.")
            at, size = _span(spans[index], index, payload.nbytes, device)
            return bytes(payload[at : at + size])
        if isinstance(value, dict):
            raise DeviceReplyError(f"{device} sent a record value {str(value)[:60]}, but a number, a string, "
                                   "{\"bytes\": blob} or {\"int\": digits} was expected; use the fleet's page.")
        return value

    if not isinstance(encoded, list) or not all(isinstance(p, list) and len(p) == 2 for p in encoded):
        raise DeviceReplyError(f"{device} sent a SecAgg+ record that is {str(encoded)[:60]}, not a list of [key, "
                               "value] pairs; use the fleet's page.")
    return {str(key): decode(value) for key, value in encoded}


def _span(span: object, index: int, limit: int, device: str) -> tuple[int, int]:
    """A blob's ``[offset, nbytes]`` from a frame's ``"blobs"``, when it lies within the payload's `limit` bytes."""
    if not isinstance(span, list) or len(span) != 2 or not all(type(v) is int and v >= 0 for v in span):
        raise DeviceReplyError(f"{device} sent a frame whose blob {index} is {str(span)[:40]}, not [offset, nbytes]; "
                               "use the fleet's page.")
    if span[0] + span[1] > limit:
        raise DeviceReplyError(f"{device} sent a frame whose blob {index} ends past its payload; use the fleet's page.")
    return span[0], span[1]


def record_frame(message_id: str, server_round: int, node: int, record: dict[str, Any]) -> bytes:
    """A ``secagg`` frame: a SecAgg+ key stage's record (setup, share keys, unmask) for Flower node `node`."""
    blobs: list[np.ndarray] = []
    header = {"type": "secagg", "id": message_id, "round": server_round, "node": str(node)}
    header["record"] = encode_record(record, blobs)
    return pack(header, blobs)


def _count(header: dict[str, Any], key: str, device: str) -> int:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeviceReplyError(f"{device} sent {key}={value!r}, but a count (an integer) was expected; use the "
                               "fleet's page.")
    return value


def _losses(header: dict[str, Any], device: str) -> list[float]:
    losses = header.get("losses", [])
    # NOTE: JSON has no NaN: a page's JSON.stringify writes a NaN loss as null.
    if not isinstance(losses, list) or not all(v is None or isinstance(v, (int, float)) for v in losses):
        raise DeviceReplyError(f"{device} sent losses that are not a list of numbers; use the fleet's page.")
    return [math.nan if v is None else float(v) for v in losses]


def _last_epoch_steps(header: dict[str, Any], steps: int) -> int | None:
    value = header.get("last_epoch_steps")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= steps:
        return None
    return value


def read_result(
    header: dict[str, Any], payload: memoryview, *, device: str, parameters: int, given: int, stated: bool = False
) -> Result:
    """Check a result frame before it reaches the strategy.

    Args:
        header: the frame's header (from `unpack`).
        payload: the frame's payload: the trained weights.
        device: the device's name, for the messages.
        parameters: how many float32 values the weights must hold.
        given: the examples per epoch the server sent; the device may claim 1 to `given`.
        stated: `given` is the bound the user stated (``max_examples``), not a count of what was sent:
            the device made its own batches.

    Raises:
        DeviceReplyError: for weights of the wrong length or not finite, an example count out of bounds.
    """
    if payload.nbytes != 4 * parameters:
        raise DeviceReplyError(f"{device} sent {payload.nbytes} bytes of weights ({payload.nbytes / 4:g} float32 "
                               f"values), but the model has {parameters} parameters; the device is refused (is its "
                               "page loading other artifacts than the fleet's?).")
    weights = np.frombuffer(payload, dtype="<f4").copy()
    bad = np.flatnonzero(~np.isfinite(weights))
    if bad.size:
        raise DeviceReplyError(f"{device} sent {bad.size} non-finite weights (NaN or infinite, the first at index "
                               f"{int(bad[0])}); the device is refused and its round goes on without it (lower the lr "
                               "if every device diverges).")
    return Result(weights, *read_counts(header, device=device, given=given, stated=stated))


def read_counts(
    header: dict[str, Any], *, device: str, given: int, stated: bool = False
) -> tuple[int, int, list[float], int | None]:
    """A reply's examples, steps, losses and last epoch's steps (`read_result`'s checks, for a masked reply too).

    Raises:
        DeviceReplyError: for an example count out of bounds, counts or losses that are not numbers.
    """
    examples = _count(header, "examples", device)
    if not 1 <= examples <= given:
        if stated:
            raise DeviceReplyError(f"{device} claims {examples} examples per epoch from its own data, but the fleet "
                                   f"allows 1 to {given} (max_examples={given}); the device is refused (raise "
                                   "max_examples if the data module makes more).")
        raise DeviceReplyError(f"{device} claims {examples} examples, but it was given {given} per epoch; a device may "
                               f"claim 1 to {given}, so the device is refused.")
    losses = _losses(header, device)
    return examples, _count(header, "steps", device), losses, _last_epoch_steps(header, len(losses))
