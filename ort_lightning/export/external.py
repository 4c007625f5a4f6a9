"""Weights outside the forward graph: ONNX external data, for models near or over protobuf's 2 GB.

A ``ModelProto`` cannot be serialized above 2 GB, and ONNX Runtime's generator refuses one.
With external data, every parameter and buffer initializer of the forward graph keeps its name,
type and shape, while its bytes live in `WEIGHTS_FILE` of a work folder (``data_location``
``EXTERNAL``, ``location`` relative to that folder). The graph then weighs kilobytes through the
passes before generation; ORT's generator sees weightless stand-ins (`ort_lightning.ort.generate`)
and the checkpoint is written from the work folder, one tensor read at a time.

Constants (shapes, axes, exponents ...) stay in the graph: ORT's generator reads them.

`external_data_wanted` decides: ``export_artifacts(..., external_data=None)`` takes this path for
every torch module (its weights are then written once, from the module's own tensors, and never
copied into a graph: a 540 MB Llama's export peaked at 3.1-3.4x its weights instead of 8x) and for an ONNX
source whose initializers exceed `AUTO_BYTES` (a smaller one already holds its weights in memory);
True forces it, False never.

Example::

    >>> import numpy as np, tempfile
    >>> from pathlib import Path
    >>> from onnx import helper, numpy_helper
    >>> weight = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    >>> proto = helper.make_model(helper.make_graph([], "g", [], [], [weight]))
    >>> folder = Path(tempfile.mkdtemp())
    >>> externalize(proto, {"w"}, folder)
    24
    >>> is_external(proto.graph.initializer[0]), (folder / WEIGHTS_FILE).stat().st_size
    (True, 24)
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
    """Bytes of a model's parameters and buffers (a torch module), or of its initializers (ONNX).

    Example::

        >>> state_bytes(torch.nn.Linear(4, 3))
        60
    """
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
    """Decide whether an export keeps the weights outside the graph: always for a torch module, by size for ONNX.

    Example::

        >>> external_data_wanted(torch.nn.Linear(4, 3), None), external_data_wanted(torch.nn.Linear(4, 3), False)
        (True, False)
    """
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
    """Turn the graph inputs named like `tensors` into initializers kept in ``directory / WEIGHTS_FILE``.

    For a graph exported without its weights (``torch.onnx.export(..., export_params=False)``),
    whose parameters and buffers are graph inputs: each tensor's bytes are written from torch's
    own memory (one tensor at a time is copied, and only off a GPU), and the input becomes an
    external initializer of the input's type and the tensor's shape. Returns the bytes written.

    Example::

        >>> import tempfile
        >>> from onnx import TensorProto, helper
        >>> inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "w")]
        >>> proto = helper.make_model(helper.make_graph([], "g", inputs, []))
        >>> attach_weights(proto, {"w": torch.ones(2)}, Path(tempfile.mkdtemp()))
        8
        >>> [i.name for i in proto.graph.input], [(t.name, is_external(t)) for t in proto.graph.initializer]
        (['x'], [('w', True)])
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

    Embedded initializers are written and emptied one at a time. Initializers that are already
    external (resolved against `source_dir`, the folder of the source file) are copied into the
    work folder, so that every weight resolves against `directory`; external initializers not
    in `names` (constants) are read back into the graph, where ONNX Runtime's generator needs them.
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
    """About what an export writes: the checkpoint holds the weights, the work folder of external data again.

    NOTE: the graphs take the weights as inputs, so they add kilobytes; a graph's own constants are
    not counted (the writers' failure reports those).

    Example::

        >>> bytes_needed(torch.nn.Linear(4, 3), external=True)
        120
    """
    return state_bytes(model) * (2 if external else 1)


@contextlib.contextmanager
def weights_folder(folder: Path, *, external: bool) -> Iterator[Path | None]:
    """A work folder inside `folder` for the weights' external data (None without), removed afterwards.

    NOTE: inside the output folder, not the system's temporary one: the weights need as much disk
    as the checkpoint, and the user chose that disk for it.

    Example::

        >>> import tempfile
        >>> with weights_folder(Path(tempfile.mkdtemp()), external=True) as work:
        ...     work.name.startswith(".weights-")
        True
    """
    if not external:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=".weights-", dir=folder) as work:
        yield Path(work)
