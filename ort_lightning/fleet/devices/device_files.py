"""A device folder as a fleet reads it: the files a device opens, and the one order of its flat weights.

`device_files` names what a device opens (the ``.ort`` graphs where present, the nominal
checkpoint if there is one), the same files for a browser's page and for a simulated device's
`ort_lightning.ort.on_device.OrtDevice`.

A device (a page, or a simulated device) sets and reads its weights as one float32 buffer (onnxruntime-web's
``loadParametersBuffer`` / ``getContiguousParameters``), laid out the way ONNX Runtime lays out
its parameters: the training graph's order of its state inputs. That order is neither the
alphabetical one of a checkpoint's listing nor, for a model with buffers such as BatchNorm's
running statistics, the manifest's ``parameter_order`` (the torch module's: parameters, then
buffers). The server declares the graph's order (`weight_order`), checks it against the order
ONNX Runtime itself uses on the device files when the fleet starts, and sends the names to every
page in its ``welcome``.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> weight_order(artifacts, device_files(artifacts))
    [('weight', (3, 4)), ('bias', (3,))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import state_specs
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.on_device import DeviceFiles

__all__ = ["check_buffer_order", "device_files", "ordered", "weight_order"]


def device_files(artifacts: TrainingArtifacts, *, complete: bool = False) -> DeviceFiles:
    """The files a device opens: ``.ort`` graphs where present, else ``.onnx``; the nominal checkpoint if any.

    Args:
        artifacts: the device folder.
        complete: open the complete checkpoint instead of the nominal one.

    Raises:
        ConfigurationError: for a folder without an optimizer graph (a device must update its weights), or
            `complete` on a folder without weights.
    """
    if artifacts.optimizer_model is None:
        raise ConfigurationError(f"{artifacts.directory} has no optimizer graph, but a device trains with one; "
                                 "export the artifacts with an optimizer (export_artifacts(..., optimizer='adamw')).")

    def fastest(path: Path) -> Path:
        return path.with_suffix(".ort") if path.with_suffix(".ort").is_file() else path

    checkpoint = artifacts.checkpoint if complete else (artifacts.nominal_checkpoint or artifacts.checkpoint)
    return DeviceFiles(training=fastest(artifacts.training_model), optimizer=fastest(artifacts.optimizer_model),
                       checkpoint=checkpoint, eval=fastest(artifacts.eval_model))


def ordered(batch: object, names: Sequence[str]) -> Sequence[Any]:
    """A batch in the training graph's input order (a dict is keyed by input name, a tuple is in order)."""
    if isinstance(batch, Mapping):
        return [batch[name] for name in names]
    return list(batch)  # type: ignore[call-overload]


def weight_order(artifacts: TrainingArtifacts, files: DeviceFiles) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every state tensor, in the order of the flat weights a page exchanges.

    Args:
        artifacts: the device folder.
        files: the files the devices open (the training graph and the checkpoint are read).

    Raises:
        ConfigurationError: for a state tensor that is not float32 (the flat buffer is float32), or an
            order that is not the one ONNX Runtime's buffer uses (see `check_buffer_order`).
    """
    specs = state_specs(artifacts)
    wrong = [spec.name for spec in specs if spec.dtype != "float32"]
    if wrong:
        raise ConfigurationError(f"A browser device exchanges float32 weights, but the state tensors {wrong} of "
                                 f"{artifacts.directory} are not float32; train such a model in a simulated fleet.")
    order = [(spec.name, tuple(int(dim) for dim in spec.shape)) for spec in specs]
    check_buffer_order([name for name, _ in order], files.training, files.checkpoint)
    return order


def check_buffer_order(names: Sequence[str], training_model: Path, checkpoint: Path) -> None:
    """Check that `names` is the order of ONNX Runtime's contiguous buffer over these files.

    Args:
        names: the declared order of the flat weights.
        training_model: the training graph the pages load.
        checkpoint: its checkpoint (nominal or complete).

    Raises:
        ConfigurationError: when ONNX Runtime lays the buffer out in another order (or holds other tensors).
    """
    measured = _ort.buffer_order(training_model, checkpoint)
    if list(names) != measured:
        raise ConfigurationError(f"The browser fleet declares its flat weights in the order {list(names)}, but ONNX "
                                 f"Runtime's parameter buffer over {training_model.name} and {checkpoint.name} holds "
                                 f"{measured}; a page would load each value into another tensor. Give the fleet the "
                                 "training graph and checkpoint of one export (export_artifacts, then "
                                 "prepare_for_web).")
