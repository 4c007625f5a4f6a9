"""DLPack bridge between torch tensors and ONNX Runtime OrtValues, without copies.

`BatchBinder` turns a DataLoader batch into one graph's inputs (moved, made contiguous and
dtype-checked only where needed) and runs one graph step on it; `to_torch` goes back the same
way; `LabelRange` refuses cross-entropy labels out of range, which ORT 1.19.2 trains on with a
wrong loss.

Example::

    >>> import torch
    >>> from ort_lightning.artifacts import TensorSpec
    >>> binder = BatchBinder((TensorSpec("input", "float32", ("batch", 3)),), torch.device("cpu"), graph="training")
    >>> x = torch.ones(2, 3)
    >>> to_torch(binder((x,))[0]).data_ptr() == x.data_ptr()
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ort_lightning.artifacts import TensorSpec
from ort_lightning.errors import BatchError
from ort_lightning.ort.runtime import OrtValue, OrtValueVector

__all__ = [
    "BatchBinder",
    "LabelRange",
    "hand_over_to_ort",
    "to_torch",
]

_from_dlpack = OrtValue.from_dlpack


def hand_over_to_ort(device: torch.device | None) -> None:
    """Wait for torch's current CUDA stream on `device`, so that ORT reads what torch wrote; no-op off CUDA."""
    # NOTE: DLPack hands ORT the memory without a stream handshake, and ORT's stream does not wait for
    # torch's: non-blocking batch copies, torch's clipping or all-reduce and a torch optimizer's update
    # must be finished before ORT reads them.
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_torch(value: Any) -> torch.Tensor:
    """View an OrtValue as a torch tensor (same memory); bool tensors stay bool."""
    tensor = torch.from_dlpack(value.to_dlpack())
    # NOTE: ORT 1.19.2 exports bool tensors as 8-bit unsigned DLPack tensors; the element type
    # is only checked for uint8 results, so float outputs pay nothing for it.
    if tensor.dtype is torch.uint8 and value.data_type() == "tensor(bool)":
        return tensor.view(torch.bool)
    return tensor


class BatchBinder:
    """Turns batches into the OrtValue inputs of one graph (`specs` in order; `graph` names it in errors)."""

    def __init__(self, specs: Sequence[TensorSpec], device: torch.device, *, graph: str) -> None:
        self.specs = tuple(specs)
        self.names = [spec.name for spec in self.specs]
        self.device = device
        self.graph = graph
        self._plan = tuple((spec.name, spec.torch_dtype, spec.dtype == "bool") for spec in self.specs)
        self._shapes = tuple(_enforced_shape(spec) for spec in self.specs)
        # NOTE: inputs whose first axis is the first input's named batch axis: one sample per row in each.
        batch = self.specs[0].shape[0] if self.specs and self.specs[0].shape else None
        self._rows = tuple(index for index, spec in enumerate(self.specs)
                           if index and isinstance(batch, str) and spec.shape and spec.shape[0] == batch)

    def __call__(self, batch: Any) -> Any:
        """Return an OrtValueVector holding `batch` in graph-input order (ORT checks the shapes).

        Raises:
            BatchError: for the wrong number of tensors, missing names, or a dtype other than the graph's.
        """
        return self.bind(self.ordered(batch))

    def step(
        self, run: Callable[[Any], Any], batch: Any, labels: LabelRange | None = None
    ) -> tuple[Sequence[torch.Tensor], Any, torch.Tensor]:
        """One graph step on `batch`: order it, check its `labels`, run; return the tensors, fetches and loss.

        Raises:
            BatchError: for a batch the graph refuses, or labels out of range.
        """
        tensors = self.ordered(batch)
        if self._rows:
            self.check_rows(tensors)
        undefined = labels is not None and labels(tensors, graph=self.graph)
        fetches = self.run(run, tensors)
        loss = to_torch(fetches[0])
        if undefined:
            # NOTE: torch's mean over no counted label is NaN; ORT 1.19.2 returns 0.0 (rare: allocates then only).
            loss = torch.full_like(loss, math.nan)
        return tensors, fetches, loss

    def check_rows(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse inputs whose batch axis is not as long as the first input's.

        Raises:
            BatchError: naming both inputs and both counts.
        """
        first = tensors[0]
        rows = first.shape[0] if first.dim() else 1
        for index in self._rows:
            tensor = tensors[index]
            if tensor.dim() and tensor.shape[0] != rows:
                raise BatchError(
                    f"Input {self.names[index]!r} of the {self.graph} graph has {tensor.shape[0]} rows, but "
                    f"{self.names[0]!r} has {rows}: both take the batch axis {self.specs[0].shape[0]!r} first, one "
                    "row per sample; return one label per sample from your Dataset (and check the collate_fn)."
                )

    def run(self, step: Callable[[Any], Any], tensors: Sequence[torch.Tensor]) -> Any:
        """Bind `tensors` and run `step`; a refused shape is diagnosed only then (a good batch pays nothing).

        Raises:
            BatchError: for a wrong dtype, rank or fixed dimension.
        """
        vector = self.bind(tensors)
        try:
            return step(vector)
        except RuntimeError as error:
            self.check_shapes(tensors, cause=error)
            raise

    def bind(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Wrap `tensors` (in graph-input order) as OrtValues without copies.

        Raises:
            BatchError: for a dtype other than the graph's, or an empty tensor.
        """
        vector = OrtValueVector()
        vector.reserve(len(tensors))
        device = self.device
        for tensor, (name, dtype, is_bool) in zip(tensors, self._plan, strict=True):
            if tensor.dtype != dtype:
                raise self._dtype_error(name, dtype, tensor)
            if not tensor.numel():
                # NOTE: ORT 1.19.2 kills the process (SIGFPE) on an empty batch; refuse it first.
                raise self._empty_error(name, tensor)
            if tensor.device != device:
                tensor = tensor.to(device)
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            if tensor.requires_grad:
                tensor = tensor.detach()
            if is_bool:
                # NOTE: ORT 1.19.2's DLPack import refuses torch's bool code (kDLBool, "Unsupported
                # code 6"); it takes the same bytes as uint8 with its is_bool flag set.
                tensor = tensor.view(torch.uint8)
            vector.push_back(_from_dlpack(tensor.__dlpack__(), is_bool))
        hand_over_to_ort(self.device)
        return vector

    def check_shapes(self, tensors: Sequence[torch.Tensor], *, cause: BaseException | None = None) -> None:
        """Raise a `BatchError` naming the first input whose rank or fixed dimensions the graph refuses."""
        for tensor, spec, shape in zip(tensors, self.specs, self._shapes, strict=True):
            if shape is not None and not _fits(tensor.shape, shape):
                raise self._shape_error(spec, tensor) from cause

    def ordered(self, batch: Any) -> Sequence[torch.Tensor]:
        """Return the tensors of `batch` in graph-input order.

        Raises:
            BatchError: for the wrong number of tensors, missing names or non-tensors.
        """
        if isinstance(batch, (tuple, list)):
            tensors: Sequence[Any] = batch
        elif isinstance(batch, Mapping):
            missing = [name for name in self.names if name not in batch]
            if missing:
                raise BatchError(
                    f"The {self.graph} graph expects inputs {self.names}, the batch dict lacks {missing} "
                    f"(it has {sorted(map(str, batch))}); key the dict by input name."
                )
            tensors = [batch[name] for name in self.names]
        elif isinstance(batch, torch.Tensor):
            tensors = (batch,)
        else:
            raise BatchError(
                f"The {self.graph} graph expects a tuple/list of tensors {self.names} or a dict keyed by "
                f"those names, but the batch is a {type(batch).__name__}; return tensors from your Dataset."
            )
        if len(tensors) != len(self.names):
            raise BatchError(
                f"The {self.graph} graph expects {len(self.names)} inputs {self.names}, the batch has "
                f"{len(tensors)} tensors; return ({', '.join(self.names)}) from your Dataset or pass a dict "
                "keyed by input name."
            )
        for name, tensor in zip(self.names, tensors, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise BatchError(
                    f"Input {name!r} of the {self.graph} graph must be a torch.Tensor, but got "
                    f"{type(tensor).__name__}; convert it in your Dataset or collate_fn."
                )
        return tensors

    def model_inputs(self, batch: Any, count: int, *, entry: str, labels_allowed: bool) -> list[torch.Tensor]:
        """The first `count` graph inputs of `batch`, checked in one line before ORT sees them.

        Args:
            batch: a tensor, a tuple/list of tensors, or a dict keyed by input name.
            count: how many of the graph's inputs are model inputs (the rest are labels).
            entry: the method the batch was passed to, for error messages.
            labels_allowed: whether a tuple/list may also hold the labels (ignored then).

        Raises:
            BatchError: for the wrong number of tensors, a missing name, a non-tensor, a wrong dtype,
                rank or fixed dimension, or an empty tensor.
        """
        names = self.names[:count]
        if isinstance(batch, Mapping):
            missing = [name for name in names if name not in batch]
            if missing:
                raise BatchError(
                    f"{entry} expects the model inputs {names}, the batch dict lacks {missing} "
                    f"(it has {sorted(map(str, batch))}); key the dict by input name."
                )
            tensors: Sequence[Any] = [batch[name] for name in names]
        elif isinstance(batch, torch.Tensor):
            tensors = (batch,)
        elif isinstance(batch, (tuple, list)):
            tensors = batch
        else:
            raise BatchError(
                f"{entry} expects the model inputs {names} as tensors, a tuple/list or a dict keyed by "
                f"those names, but got a {type(batch).__name__}; return tensors from your Dataset."
            )
        accepted = (count, len(self.names)) if labels_allowed else (count,)
        if len(tensors) not in accepted:
            extra = f" (or also the labels {self.names[count:]})" if labels_allowed and count < len(self.names) else ""
            raise BatchError(
                f"{entry} expects {count} model input{'s' if count != 1 else ''} {names}{extra}, but got "
                f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''}; pass ({', '.join(names)}) only: the "
                "labels are not needed."
            )
        tensors = list(tensors[:count])
        for tensor, spec, shape in zip(tensors, self.specs, self._shapes, strict=False):
            if not isinstance(tensor, torch.Tensor):
                raise BatchError(
                    f"Input {spec.name!r} of {entry} must be a torch.Tensor, but got {type(tensor).__name__}; "
                    "convert it first (torch.as_tensor)."
                )
            if shape is not None and not _fits(tensor.shape, shape):
                raise self._shape_error(spec, tensor)
        return tensors

    def _dtype_error(self, name: str, expected: torch.dtype, tensor: torch.Tensor) -> BatchError:
        target = str(expected).replace("torch.", "")
        return BatchError(
            f"Input {name!r} of the {self.graph} graph expects dtype {target}, but the batch gives "
            f"{str(tensor.dtype).replace('torch.', '')}; convert it in your Dataset or collate_fn "
            f"(tensor.to(torch.{target}))."
        )

    def _empty_error(self, name: str, tensor: torch.Tensor) -> BatchError:
        return BatchError(
            f"Input {name!r} of the {self.graph} graph is empty (shape {tuple(tensor.shape)}, 0 elements), but the "
            "graph needs at least one sample; use DataLoader(drop_last=True) if the last batch comes out empty, or "
            "filter empty samples out of your Dataset."
        )

    def _shape_error(self, spec: TensorSpec, tensor: torch.Tensor) -> BatchError:
        dims = [str(dim) if dim else "?" for dim in spec.shape]
        expected = f"{dims[0]}," if len(dims) == 1 else ", ".join(dims)
        return BatchError(
            f"Input {spec.name!r} of the {self.graph} graph expects shape ({expected}), but the batch gives "
            f"{tuple(tensor.shape)}; reshape it in your Dataset or collate_fn (named dimensions are free, "
            "numbers must match)."
        )


class LabelRange:
    """Refuse cross-entropy labels outside ``[0, classes)`` (ORT trains on them with a wrong loss).

    `ignore_index` is a label the loss skips; under the ``"mean"`` `reduction` a batch of ignored
    labels only has an undefined loss (torch's is NaN), which the call reports.

    Example::

        >>> guard = LabelRange("labels", index=1, classes=3, ignore_index=-100)
        >>> guard((torch.zeros(2, 4), torch.tensor([-100, -100])), graph="training")  # torch's loss: NaN
        True
        >>> guard((torch.zeros(2, 4), torch.tensor([0, 3])), graph="training")
        Traceback (most recent call last):
        ...
        ort_lightning.errors.BatchError: Labels 'labels' of the training graph must be class indices in [0, 3) ...
    """

    def __init__(
        self, name: str, *, index: int, classes: int, ignore_index: int | None = None, reduction: str = "mean"
    ) -> None:
        self.name = name
        self.index = index
        self.classes = classes
        self.ignore_index = ignore_index
        self.reduction = reduction

    def __call__(self, tensors: Sequence[torch.Tensor], *, graph: str) -> bool:
        """Check the labels among `tensors`; return whether the batch's loss is undefined (all ignored, mean).

        Raises:
            BatchError: naming the labels, the range found and the range expected.
        """
        labels = tensors[self.index]
        if labels.numel() == 0 or labels.is_floating_point():
            return False  # the binder refuses empty batches and other dtypes with messages of their own
        low, high = (int(value) for value in torch.aminmax(labels))
        if self.ignore_index is not None and self.ignore_index in (low, high):
            if low == high:  # every label is ignored
                return self.reduction == "mean"
            # NOTE: only batches that hold ignored labels pay for the second, masked reduction.
            low, high = self._counted_range(labels, low, high)
        if low < 0 or high >= self.classes:
            ignored = f" besides ignore_index={self.ignore_index}" if self.ignore_index is not None else ""
            raise BatchError(
                f"Labels {self.name!r} of the {graph} graph must be class indices in [0, {self.classes}){ignored}, but "
                f"the batch has values in [{low}, {high}] (ORT would train on them silently with a wrong loss); fix "
                f"the labels in your Dataset, re-export the model with as many classes as the labels need, or pass "
                "ORTLightningModule(check_labels=False) to skip this check."
            )
        return False

    def _counted_range(self, labels: torch.Tensor, low: int, high: int) -> tuple[int, int]:
        """The range of the labels other than `ignore_index` (``(0, 0)`` when all are ignored)."""
        counted = labels[labels != self.ignore_index]
        if counted.numel() == 0:
            return 0, 0
        return tuple(int(value) for value in torch.aminmax(counted))  # type: ignore[return-value]


def _enforced_shape(spec: TensorSpec) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """The rank and the fixed ``(axis, size)`` pairs ORT checks; None when the graph gives no shape."""
    if not spec.shape:
        return None
    fixed = tuple((axis, dim) for axis, dim in enumerate(spec.shape) if isinstance(dim, int) and dim > 0)
    return len(spec.shape), fixed


def _fits(shape: torch.Size, enforced: tuple[int, tuple[tuple[int, int], ...]]) -> bool:
    rank, fixed = enforced
    return len(shape) == rank and all(shape[axis] == size for axis, size in fixed)
