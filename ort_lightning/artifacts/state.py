"""The state tensors of a set of artifacts, in the training graph's order, and values for them.

That order is ORT's parameter buffer's (``copy_buffer_to_parameters``), not the checkpoint's
alphabetical one; the graph also gives shapes and types, so values are checked without reading
a checkpoint (a nominal one has names only).

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> [(spec.name, spec.shape) for spec in state_specs(artifacts)]
    [('weight', (3, 4)), ('bias', (3,))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from ort_lightning.artifacts.adopted import graph_io
from ort_lightning.artifacts.checks import read_graph
from ort_lightning.artifacts.manifest import TensorSpec
from ort_lightning.errors import ArtifactError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.graph_files import ort_inputs

if TYPE_CHECKING:
    from pathlib import Path

    from ort_lightning.artifacts.folder import TrainingArtifacts

__all__ = ["check_shapes", "check_values", "flat_values", "state_specs", "state_summary"]



@lru_cache(maxsize=32)
def _graph_inputs(path: Path, mtime_ns: int) -> tuple[TensorSpec, ...]:
    # NOTE: the graph's structure only; weights stay on disk. An .onnx graph's facts are those the folder check read.
    return read_graph(path).inputs if path.suffix == ".onnx" else tuple(graph_io(path)[0])


def state_specs(artifacts: TrainingArtifacts) -> list[TensorSpec]:
    """One `TensorSpec` per parameter and buffer of `artifacts`, in the training graph's order."""
    path = artifacts.training_model
    inputs = _graph_inputs(path, path.stat().st_mtime_ns)
    skip = {spec.name for spec in artifacts.manifest.graph_inputs} | ort_inputs([spec.name for spec in inputs])
    return [spec for spec in inputs if spec.name not in skip]


def state_summary(artifacts: TrainingArtifacts) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(name, shape, trainable)`` of every state tensor, from the checkpoint or, weightless, the graph."""
    if not artifacts.weightless:
        return _ort.checkpoint_summary(artifacts.checkpoint)[0]
    trainable = set(artifacts.manifest.trainable)
    return [(spec.name, tuple(int(dim) for dim in spec.shape), spec.name in trainable)
            for spec in state_specs(artifacts)]


def check_shapes(
    shapes: Mapping[str, Sequence[int]], specs: Sequence[TensorSpec], *, source: Path, artifacts: TrainingArtifacts
) -> None:
    """Refuse a state loaded from `source` whose shapes are not the training graph's (`ArtifactError` naming both)."""
    for spec in specs:
        shape = shapes.get(spec.name)
        if shape is not None and not _fits(tuple(shape), spec.shape):
            raise ArtifactError(
                f"The checkpoint {source} holds {spec.name} of shape {list(shape)}, but "
                f"{artifacts.training_model.name} takes {spec.name} of shape {list(spec.shape)}: the checkpoint "
                "belongs to another model with the same parameter names; use the checkpoint exported with these graphs."
            )


def _fits(shape: tuple[int, ...], expected: tuple[int | str, ...]) -> bool:
    return len(shape) == len(expected) and all(
        isinstance(want, str) or want == have for want, have in zip(expected, shape, strict=True))


def _as_tensor(value: object) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


def check_values(values: Mapping[str, object], specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """`values` as tensors in the order of `specs`, every name and shape checked (`ConfigurationError`)."""
    expected = [spec.name for spec in specs]
    missing = [name for name in expected if name not in values]
    unexpected = sorted(set(values) - set(expected))
    if missing or unexpected:
        raise ConfigurationError(
            f"Expected values for exactly the state tensors {expected}, but {missing} are missing and "
            f"{unexpected} unexpected; send the values of the same artifacts (get_values of a module built from them)."
        )
    tensors = {}
    for spec in specs:
        value = _as_tensor(values[spec.name])
        if tuple(value.shape) != tuple(spec.shape):
            raise ConfigurationError(
                f"Expected value {spec.name!r} of shape {tuple(spec.shape)}, but got {tuple(value.shape)}; send the "
                "values of the same artifacts to every client."
            )
        tensors[spec.name] = value
    return tensors


def flat_values(values: Mapping[str, object], specs: Sequence[TensorSpec]) -> np.ndarray:
    """`values` in one contiguous float32 buffer in the order of `specs`, as ORT's parameter buffer holds them.

    Raises:
        ConfigurationError: for values `check_values` refuses, or state tensors that are not float32.
    """
    others = [f"{spec.name} ({spec.dtype})" for spec in specs if spec.dtype != "float32"]
    if others:
        raise ConfigurationError(
            f"ORT's parameter buffer holds float32 values, but the state tensors {others} are not float32; start "
            "such artifacts from their complete checkpoint and copy the values in afterwards (set_values)."
        )
    tensors = check_values(values, specs)
    if not tensors:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([t.detach().cpu().to(torch.float32).reshape(-1).numpy() for t in tensors.values()])
