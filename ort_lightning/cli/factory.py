"""Export from a ``package.module:factory`` spec and input shapes: what ``export`` and a config's ``export:`` name.

Example::

    >>> parse_shape("3,32,32")
    (3, 32, 32)
    >>> parse_shape("3x32x32")
    Traceback (most recent call last):
    ...
    ort_lightning.cli.usage.UsageError: bad --input-shape '3x32x32': expected the dimensions without the batch ...
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from ort_lightning.cli.usage import UsageError

__all__ = ["example_inputs", "export_factory", "load_factory", "parse_shape"]


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"3,32,32"`` (one model input's shape without the batch dimension; `UsageError` else)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise UsageError(
            f"bad --input-shape {text!r}: expected the dimensions without the batch dimension as positive integers "
            "separated by commas, e.g. --input-shape 3,32,32"
        )
    return tuple(int(part) for part in parts)


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``package.module:factory`` and return the callable (`UsageError` if there is none)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(
            f"Expected an .onnx file or package.module:factory, but got {spec!r}; e.g. ort_lightning.demo:digits_mlp."
        )
    factory = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(factory):
        raise UsageError(f"{module_name} has no callable {attribute!r}; name a function that builds the model.")
    return factory


def example_inputs(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> tuple[Any, ...]:
    """Zero tensors of batch 2 with these per-input shapes and dtypes (default float32; `UsageError` else)."""
    import torch

    if not shapes:
        raise UsageError("A torch factory needs --input-shape for each model input, e.g. --input-shape 64.")
    if dtypes and len(dtypes) != len(shapes):
        raise UsageError(f"Got {len(shapes)} --input-shape but {len(dtypes)} --input-dtype; give one per input.")
    examples = []
    for index, shape in enumerate(shapes):
        dtype = getattr(torch, dtypes[index] if dtypes else "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"Unknown --input-dtype {dtypes[index]!r}; use a torch dtype name such as float32.")
        examples.append(torch.zeros((2, *shape), dtype=dtype))
    return tuple(examples)


def export_factory(
    spec: str,
    shapes: Sequence[Sequence[int]],
    output_dir: str | os.PathLike[str],
    *,
    dtypes: Sequence[str] = (),
    **options: Any,
) -> Any:
    """Build the model `spec` names and export it with example inputs of `shapes`; return the `TrainingArtifacts`.

    Raises:
        UsageError: when the factory returns no torch module, or the model cannot run on these shapes.
    """
    import torch

    from ort_lightning import export_artifacts

    model = load_factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, expected a torch.nn.Module.")
    examples = example_inputs(shapes, dtypes)
    training = model.training
    try:
        # NOTE: one eager forward first, so that a shape mistake reads as one, not as an exporter trace.
        with torch.no_grad():
            model.eval()(*examples)
    except RuntimeError as error:
        given = ", ".join(",".join(map(str, shape)) for shape in shapes)
        raise UsageError(
            f"{spec} cannot run on inputs of shape (batch, {given}) ({str(error).splitlines()[0]}); "
            "give the shape of one sample without the batch dimension with --input-shape "
            "(in a config: export.input_shape), e.g. --input-shape 1,12,12 for 1-channel 12x12 images"
        ) from error
    return export_artifacts(model.train(training), examples, output_dir, **options)
