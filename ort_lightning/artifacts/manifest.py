"""The manifest of a set of artifacts, ``ort_lightning.json``, and the `TensorSpec` of each graph input."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from ort_lightning.artifacts.schedule import KINDS as SCHEDULE_KINDS
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

    @classmethod
    def of_inputs(cls, infos: Iterable[onnx.ValueInfoProto]) -> tuple[TensorSpec, ...]:
        """Read every input of a graph; one that is not a tensor (a sequence) has the dtype ``"sequence"``.

        Example::

            >>> from onnx import TensorProto, helper
            >>> infos = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            ...          helper.make_tensor_sequence_value_info("xs", TensorProto.FLOAT, None)]
            >>> [(spec.name, spec.dtype, spec.shape) for spec in TensorSpec.of_inputs(infos)]
            [('x', 'float32', ('batch', 4)), ('xs', 'sequence', ())]
        """
        return tuple(
            cls.from_value_info(info) if info.type.HasField("tensor_type") else cls(info.name, "sequence", ())
            for info in infos
        )


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
    #: sha256 of the complete ``checkpoint`` as exported; None in manifests written before it (nothing to check).
    checkpoint_sha256: str | None = None

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
        _check_fields(data, source)
        return cls(
            inputs=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in data["inputs"]),
            labels=tuple(TensorSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in data["labels"]),
            **{key: _freeze(data[key]) for key in _SCALAR_FIELDS},
            verification=data.get("verification"),
            loss_options=dict(data.get("loss_options", {})),
            parameter_order=tuple(data.get("parameter_order", ())),
            checkpoint_sha256=data.get("checkpoint_sha256"),
            lr_schedule=GraphSchedule.from_dict(data["lr_schedule"]) if data.get("lr_schedule") else None,
        )

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Read and parse the manifest file `path` (`from_json`), refusing bytes that are not UTF-8 text.

        Raises:
            ArtifactError: naming `path` and what to do.
        """
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ArtifactError(
                f"{path} is not UTF-8 text ({error.reason} at byte {error.start}), so it is no manifest that "
                "export_artifacts() wrote: it is damaged or another file; re-export the artifacts with "
                "export_artifacts(), or copy ort_lightning.json again from the folder it was exported to."
            ) from error
        return cls.from_json(text, path)


_SCALAR_FIELDS = (
    "loss", "loss_output", "outputs", "optimizer", "optimizer_options", "trainable", "frozen", "buffers",
    "versions",
)


#: The loss kinds a manifest may name: export_artifacts' losses, a custom block, a model that returns its loss.
LOSS_KINDS = (
    "cross_entropy", "nll", "mse", "l1", "bce_with_logits", "smooth_l1", "huber", "custom", "model",
    "mse|l1|bce_with_logits",
)
#: The optimizer kinds a manifest may name.
OPTIMIZER_KINDS = ("adamw", "sgd", "none")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_NAMES = "a list of names"


def _is_names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_specs(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(spec, dict) and isinstance(spec.get("name"), str) and spec.get("dtype") in _DTYPES
        and isinstance(spec.get("shape"), list) and all(isinstance(dim, int | str) for dim in spec["shape"])
        for spec in value
    )


def _is_digest(value: Any) -> bool:
    return value is None or (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef"))


def _is_schedule(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict) or value.get("kind") not in SCHEDULE_KINDS:
        return False
    lr, warmup, total = value.get("lr"), value.get("warmup_steps", 0), value.get("total_steps")
    numbers = isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0 and isinstance(warmup, int)
    return numbers and warmup >= 0 and (total is None or (isinstance(total, int) and total >= 1))


#: Field -> (whether it is required, its check, what it should be).
_FIELDS: dict[str, tuple[bool, Any, str]] = {
    "inputs": (True, _is_specs, f"a list of {{name, dtype (one of {list(_DTYPES)}), shape: [int | str]}}"),
    "labels": (True, _is_specs, "a list of {name, dtype, shape}, like inputs"),
    "loss": (True, lambda v: v in LOSS_KINDS, f"one of {list(LOSS_KINDS)}"),
    "loss_output": (True, lambda v: isinstance(v, str), "the name of the training graph's loss output"),
    "outputs": (True, _is_names, _NAMES),
    "optimizer": (True, lambda v: v in OPTIMIZER_KINDS, f"one of {list(OPTIMIZER_KINDS)}"),
    "optimizer_options": (True, lambda v: isinstance(v, dict), "an object of hyper-parameters"),
    "trainable": (True, _is_names, _NAMES),
    "frozen": (True, _is_names, _NAMES),
    "buffers": (True, _is_names, _NAMES),
    "versions": (True, lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                 "an object of package -> version string"),
    "verification": (False, lambda v: v is None or isinstance(v, dict), "an object or null"),
    "loss_options": (False, lambda v: isinstance(v, dict), "an object of loss options"),
    "parameter_order": (False, _is_names, _NAMES),
    "checkpoint_sha256": (False, _is_digest, "64 lowercase hex digits (the checkpoint's sha256) or null"),
    "lr_schedule": (False, _is_schedule, "null or {kind: constant | linear, lr > 0, warmup_steps: int, total_steps}"),
}


def _check_fields(data: dict[str, Any], source: Path) -> None:
    """Refuse a manifest with a missing field, or one whose value has the wrong type or an unknown value.

    Raises:
        ArtifactError: naming the field, its value, what it should be, and what to do.
    """
    for key, (required, valid, expected) in _FIELDS.items():
        if key not in data:
            if required:
                raise ArtifactError(
                    f"{source} lacks or mangles the field {key!r} (it is missing); re-export the artifacts with "
                    "export_artifacts()."
                )
            continue
        if not valid(data[key]):
            shown = json.dumps(data[key])
            raise ArtifactError(
                f"{source} has {key}={shown[:120]}, but expected {expected}; the manifest is damaged or was edited by "
                "hand: re-export the artifacts with export_artifacts(), or copy ort_lightning.json again from the "
                "folder they were exported to."
            )


def _freeze(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value
