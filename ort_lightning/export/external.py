"""Weights outside the forward graph: ONNX external data, for models near or over protobuf's 2 GB.

A ``ModelProto`` cannot be serialized above 2 GB, and ORT's generator refuses one. Here every
weight initializer keeps its name, type and shape while its bytes live in `WEIGHTS_FILE` of a
work folder; the passes handle a graph of kilobytes, the generator sees stand-ins, and the
checkpoint is written from the work folder. Constants stay in the graph (the generator reads them).

Example::

    >>> import numpy as np, tempfile
    >>> from onnx import helper, numpy_helper
    >>> weight = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    >>> proto = helper.make_model(helper.make_graph([], "g", [], [], [weight]))
    >>> folder = Path(tempfile.mkdtemp())
    >>> externalize(proto, {"w"}, folder), is_external(proto.graph.initializer[0])
    (24, True)
    >>> read_array(proto.graph.initializer[0], folder).sum()
    np.float32(6.0)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ort_lightning.ort.graph_files import READ_ERRORS

__all__ = [
    "AUTO_BYTES",
    "WEIGHTS_FILE",
    "attach_weights",
    "bytes_needed",
    "external_data_wanted",
    "externalize",
    "is_external",
    "read_array",
    "state_bytes",
    "weights_folder",
]

#: An ONNX source's initializers above this many bytes go through external data by default (protobuf's
#: limit is 2 GiB for the whole graph; half of it leaves room for the graph and what passes add).
#: A torch module always does.
AUTO_BYTES = 1 << 30
#: The file of a work folder that holds the weights, as ONNX external data.
WEIGHTS_FILE = "weights.onnx.data"
_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def is_external(tensor: onnx.TensorProto) -> bool:
    """Whether `tensor`'s bytes live outside the graph (ONNX external data)."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def read_array(tensor: onnx.TensorProto, base_dir: str | os.PathLike[str] | None = None) -> np.ndarray:
    """The value of an initializer, embedded or external (resolved against `base_dir`)."""
    return numpy_helper.to_array(tensor, os.fspath(base_dir) if base_dir is not None else "")


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    if is_external(tensor):
        lengths = [entry.value for entry in tensor.external_data if entry.key == "length"]
        if lengths:
            return int(lengths[0])
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    return count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def state_bytes(model: Any) -> int:
    """Bytes of a model's parameters and buffers (a torch module), or of its initializers (ONNX)."""
    if isinstance(model, torch.nn.Module):
        tensors = [*model.parameters(), *model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
    if isinstance(model, onnx.ModelProto):
        return sum(_tensor_bytes(t) for t in model.graph.initializer)
    if isinstance(model, (str, os.PathLike)) and Path(model).is_file():
        try:
            graph = onnx.load(os.fspath(model), load_external_data=False).graph
        except READ_ERRORS:  # not ONNX: the source stage says so, in the words it owes the user
            return 0
        return sum(_tensor_bytes(t) for t in graph.initializer)
    return 0


def external_data_wanted(model: Any, external_data: bool | None) -> bool:
    """Whether an export keeps the weights outside the graph: always for a torch module, by size for ONNX."""
    if external_data is not None:
        return bool(external_data)
    return isinstance(model, torch.nn.Module) or state_bytes(model) > AUTO_BYTES


def _point(tensor: onnx.TensorProto, offset: int, length: int) -> None:
    """Make `tensor` an external reference to ``WEIGHTS_FILE[offset:offset+length]``, its bytes dropped."""
    for name in _DATA_FIELDS:
        tensor.ClearField(name)
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def attach_weights(proto: onnx.ModelProto, tensors: Mapping[str, torch.Tensor], directory: Path) -> int:
    """Turn the graph inputs named like `tensors` into external initializers in ``directory / WEIGHTS_FILE``.

    For a graph exported without its weights (``export_params=False``): each tensor is written from
    torch's own memory, one at a time. Returns the bytes written.
    """
    written = 0
    kept: list[onnx.ValueInfoProto] = []
    with open(directory / WEIGHTS_FILE, "ab") as sink:
        for info in proto.graph.input:
            tensor = tensors.get(info.name)
            if tensor is None:
                kept.append(info)
                continue
            data = tensor.detach().cpu().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy()
            initializer = onnx.TensorProto(name=info.name, data_type=info.type.tensor_type.elem_type, dims=data.shape)
            offset = sink.tell()
            sink.write(raw.data)
            _point(initializer, offset, raw.nbytes)
            proto.graph.initializer.append(initializer)
            written += raw.nbytes
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    return written


def externalize(
    proto: onnx.ModelProto,
    names: Collection[str],
    directory: Path,
    *,
    source_dir: str | os.PathLike[str] | None = None,
) -> int:
    """Move the bytes of the initializers in `names` to ``directory / WEIGHTS_FILE``; return the bytes written.

    External ones are copied from `source_dir`; external constants not in `names` come back into the graph.
    """
    written = 0
    with open(directory / WEIGHTS_FILE, "ab") as sink:
        for tensor in proto.graph.initializer:
            if tensor.name not in names:
                if is_external(tensor):
                    tensor.CopyFrom(numpy_helper.from_array(read_array(tensor, source_dir), tensor.name))
                continue
            if is_external(tensor) and source_dir is not None and Path(source_dir) == directory:
                continue
            # NOTE: raw bytes as they are; only other encodings (float_data ...) go through numpy.
            embedded = not is_external(tensor) and tensor.HasField("raw_data")
            data = tensor.raw_data if embedded else read_array(tensor, source_dir).tobytes()
            offset = sink.tell()
            sink.write(data)
            _point(tensor, offset, len(data))
            written += len(data)
    return written


def bytes_needed(model: Any, *, external: bool) -> int:
    """About what an export writes: the checkpoint holds the weights, and the work folder again if `external`."""
    return state_bytes(model) * (2 if external else 1)


@contextlib.contextmanager
def weights_folder(folder: Path, *, external: bool) -> Iterator[Path | None]:
    """A work folder inside `folder` for the weights' external data (None without), removed afterwards.

    NOTE: not in the system's temporary folder: the user chose this disk for the weights.
    """
    if not external:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=".weights-", dir=folder) as work:
        yield Path(work)
