"""The manifest of a set of artifacts: ``ort_lightning.json``, and the `TensorSpec` of each graph input.

`export_artifacts` writes it, `TrainingArtifacts.load` reads it back; it records the inputs,
labels and outputs of the graphs, the loss, the optimizer and its hyper-parameters, the
parameter names, and the versions of the packages that made the artifacts.

Example::

    >>> spec = TensorSpec("input", "float32", ("batch", 4))
    >>> spec.torch_dtype
    torch.float32
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from ort_lightning.artifacts.schedule import GraphSchedule
from ort_lightning.errors import ArtifactError

__all__ = ["MANIFEST_NAME", "UNVERIFIED_NAME", "Manifest", "TensorSpec"]

MANIFEST_NAME = "ort_lightning.json"
#: Left by an export whose verification failed, so that its graphs are not adopted as a foreign folder.
UNVERIFIED_NAME = "ort_lightning.unverified"
_FORMAT = "ort-lightning/artifacts"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """Name, element type and shape of a graph input; symbolic dimensions are strings.

    Example::

        >>> TensorSpec("input", "float32", ("batch", 4)).torch_dtype
        torch.float32
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype a batch tensor for this input must have."""
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @classmethod
    def from_value_info(cls, info: onnx.ValueInfoProto) -> TensorSpec:
        """Read a graph input of an ONNX model."""
        tensor_type = info.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
        shape = tuple(dim.dim_param or dim.dim_value for dim in tensor_type.shape.dim)
        return cls(info.name, dtype, shape)


@dataclass(frozen=True)
class Manifest:
    """What `ort_lightning.json` records about a set of artifacts."""

    inputs: tuple[TensorSpec, ...]
    labels: tuple[TensorSpec, ...]
    loss: str
    loss_output: str
    outputs: tuple[str, ...]
    optimizer: str
    optimizer_options: dict[str, Any]
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    buffers: tuple[str, ...]
    versions: dict[str, str] = field(default_factory=dict)
    #: Export-time verification report (`ort_lightning.export.verify.verifier`); None in manifests written before it.
    verification: dict[str, Any] | None = None
    #: The loss's options (``reduction``, ``ignore_index``, ``weight`` ...); empty for a custom or model loss.
    loss_options: dict[str, Any] = field(default_factory=dict)
    #: Parameter and buffer names in the model's own order (the torch module's, else the training graph's);
    #: empty in manifests written before it, whose parameters keep ONNX Runtime's (alphabetical) order.
    parameter_order: tuple[str, ...] = ()
    #: The learning rate the optimizer graph computes itself (``prepare_for_web``); None: the runtime feeds it.
    lr_schedule: GraphSchedule | None = None

    @property
    def graph_inputs(self) -> tuple[TensorSpec, ...]:
        """Inputs of the training and eval graphs in order: model inputs, then labels."""
        return self.inputs + self.labels

    def in_model_order(self, names: Sequence[str]) -> list[str]:
        """Return `names` in `parameter_order`; names it does not list keep their order, after the others.

        Example::

            >>> order = ("b", "a")
            >>> manifest = Manifest((), (), "mse", "loss", (), "sgd", {}, ("a", "b"), (), (), parameter_order=order)
            >>> manifest.in_model_order(["a", "b", "c"])
            ['b', 'a', 'c']
        """
        rank = {name: index for index, name in enumerate(self.parameter_order)}
        return sorted(names, key=lambda name: rank.get(name, len(rank)))

    def to_json(self) -> str:
        """Serialize with the format marker that `from_json` checks."""
        return json.dumps({"format": _FORMAT, "format_version": _FORMAT_VERSION, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str, source: Path) -> Manifest:
        """Parse a manifest, refusing files that another tool or version wrote.

        Raises:
            ArtifactError: naming `source` and what to do.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ArtifactError(
                f"{source} is not valid JSON ({error}); re-export the artifacts with export_artifacts()."
            ) from error
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ArtifactError(
                f"{source} is not an ort-lightning manifest (expected \"format\": \"{_FORMAT}\"); "
                "point to a folder written by export_artifacts(), or re-export the model there."
            )
        if data.get("format_version") != _FORMAT_VERSION:
            raise ArtifactError(
                f"{source} has manifest format_version {data.get('format_version')!r}, this ort-lightning "
                f"reads {_FORMAT_VERSION}; re-export the artifacts with this version."
            )
        try:
            return cls(
                inputs=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in data["inputs"]),
                labels=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in data["labels"]),
                **{key: _freeze(data[key]) for key in _SCALAR_FIELDS},
                verification=data.get("verification"),
                loss_options=dict(data.get("loss_options", {})),
                parameter_order=tuple(data.get("parameter_order", ())),
                lr_schedule=GraphSchedule.from_dict(data["lr_schedule"]) if data.get("lr_schedule") else None,
            )
        except (KeyError, TypeError) as error:
            raise ArtifactError(
                f"{source} lacks or mangles the field {error}; re-export the artifacts with "
                "export_artifacts()."
            ) from error


_SCALAR_FIELDS = (
    "loss", "loss_output", "outputs", "optimizer", "optimizer_options", "trainable", "frozen", "buffers",
    "versions",
)


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
