"""An ORT checkpoint file's properties: exactly those its writer gives, none carried over.

ORT 1.19.2 saves every property a state was loaded with and removes none, so a resumed run would
write the first run's ``monitor_value`` as its own. `replace_properties` appends a new
``PropertyBag`` flatbuffer to the saved file and points the root table at it: one append and one
4-byte write, whatever the file's size.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import BinaryIO

import flatbuffers

from ort_lightning.errors import CheckpointError
from ort_lightning.ort._api import ort_flatbuffers as _fbs

__all__ = ["property_bag", "replace_properties"]

#: The slot of ``property_bag`` in the ``Checkpoint`` table (its fourth field).
_BAG_SLOT = 3
#: Every scalar in the file is at most 8 bytes wide: an append at a multiple of 8 keeps the new bag aligned.
_ALIGN = 8
_UOFFSET_LIMIT = 2**32


def property_bag(properties: Mapping[str, int | float | str]) -> bytes:
    """A ``PropertyBag`` flatbuffer holding `properties`: str as string, float as float, the rest int64."""
    builder = flatbuffers.Builder(256)
    builder.ForceDefaults(True)  # NOTE: an int 0 or float 0.0 is written, not left to the schema's default
    ints, floats, strings = [], [], []
    for name, value in properties.items():
        key = builder.CreateString(name)
        if isinstance(value, str):
            text = builder.CreateString(value)
            _fbs.StringProperty.Start(builder)
            _fbs.StringProperty.AddName(builder, key)
            _fbs.StringProperty.AddValue(builder, text)
            strings.append(_fbs.StringProperty.End(builder))
        elif isinstance(value, float):
            _fbs.FloatProperty.Start(builder)
            _fbs.FloatProperty.AddName(builder, key)
            _fbs.FloatProperty.AddValue(builder, value)
            floats.append(_fbs.FloatProperty.End(builder))
        else:
            _fbs.IntProperty.Start(builder)
            _fbs.IntProperty.AddName(builder, key)
            _fbs.IntProperty.AddValue(builder, int(value))
            ints.append(_fbs.IntProperty.End(builder))
    vectors = [_vector(builder, items) for items in (ints, floats, strings)]
    _fbs.PropertyBag.Start(builder)
    _fbs.PropertyBag.AddInts(builder, vectors[0])
    _fbs.PropertyBag.AddFloats(builder, vectors[1])
    _fbs.PropertyBag.AddStrings(builder, vectors[2])
    # NOTE: the builder aligns from the buffer's end and pads the whole to its widest scalar, so the bag's
    # scalars stay aligned wherever it lands at a multiple of 8.
    builder.Finish(_fbs.PropertyBag.End(builder))
    return bytes(builder.Output())


def _vector(builder: flatbuffers.Builder, items: list[int]) -> int:
    builder.StartVector(4, len(items), 4)
    for item in reversed(items):
        builder.PrependUOffsetTRelative(item)
    return int(builder.EndVector())


def replace_properties(path: str | os.PathLike[str], properties: Mapping[str, int | float | str]) -> None:
    """Make the checkpoint file `path` hold exactly `properties` (ONNX Runtime saved it a moment ago).

    Raises:
        CheckpointError: for a file that is not an ORT checkpoint, or one without a property bag when
            `properties` is not empty.
    """
    with open(path, "r+b") as stream:
        head = stream.read(4)
        stream.seek(0, os.SEEK_END)
        size = stream.tell()
        field = _bag_field(stream, head, size, path)
        if field is None:
            if properties:
                raise CheckpointError(
                    f"Checkpoint {os.fspath(path)} has no property bag to replace; save it from a state that holds "
                    "at least one property (ONNX Runtime writes the bag only then)."
                )
            return
        start = size + (-size % _ALIGN)
        bag = property_bag(properties)
        target = start + struct.unpack_from("<I", bag, 0)[0]
        if target - field >= _UOFFSET_LIMIT:  # pragma: no cover - a flatbuffer file is below 2 GB (ORT's limit)
            raise CheckpointError(f"Checkpoint {os.fspath(path)} is too large for its properties to be replaced.")
        stream.seek(size)
        stream.write(b"\0" * (start - size) + bag)
        stream.seek(field)
        stream.write(struct.pack("<I", target - field))


def _bag_field(stream: BinaryIO, head: bytes, size: int, path: str | os.PathLike[str]) -> int | None:
    """The file position of the root table's ``property_bag`` offset; None without one."""
    try:
        (root,) = struct.unpack("<I", head)
        stream.seek(root)
        (back,) = struct.unpack("<i", stream.read(4))
        vtable = root - back
        stream.seek(vtable)
        (vtable_size,) = struct.unpack("<H", stream.read(2))
        slot = 4 + 2 * _BAG_SLOT
        if not 0 <= vtable < size or not 0 <= root < size:
            raise struct.error("offset outside the file")
        if slot + 2 > vtable_size:
            return None
        stream.seek(vtable + slot)
        (offset,) = struct.unpack("<H", stream.read(2))
    except struct.error as error:
        raise CheckpointError(
            f"{os.fspath(path)} is not an ONNX Runtime checkpoint ({error}); save it with ONNX Runtime again."
        ) from error
    return root + offset if offset else None
