"""`OrtDevice`: ONNX Runtime's own device loop in Python, step for step as ``web/runner.js``.

Open the files, copy the server's weights in, then per batch one train step, one optimizer step
and a gradient reset, and the weights back as one float32 buffer: what a phone or a browser tab
runs, so that a simulated device and a browser train the same files to the same numbers. One
intra-op thread by default, as onnxruntime-web runs a page.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts
    >>> folder = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(),
    ...                           nominal_checkpoint=True, verify=False).directory
    >>> files = DeviceFiles(training=folder / "training_model.onnx", optimizer=folder / "optimizer_model.onnx",
    ...                     checkpoint=folder / "nominal_checkpoint")
    >>> device = OrtDevice.open(files, weights=np.zeros(15, np.float32), lr=0.1)
    >>> trained = device.train([[np.ones((2, 4), np.float32), np.array([0, 2])]], epochs=3)
    >>> trained.steps, trained.examples, len(device.get_weights())
    (3, 2, 15)
    >>> device.release()
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ort_lightning.errors import ConfigurationError
from ort_lightning.ort._api import CheckpointState, Module, Optimizer, onnxruntime
from ort_lightning.ort.checkpoint_state import copy_parameters, state_outlives
from ort_lightning.ort.options import session_options
from ort_lightning.ort.session import refused

__all__ = ["DeviceFiles", "OrtDevice", "Trained"]


@dataclass(frozen=True)
class DeviceFiles:
    """The files a device opens (training, optimizer and eval graphs, checkpoint), as ``runner.js`` names them."""

    training: Path
    optimizer: Path
    checkpoint: Path
    eval: Path | None = None

    def by_role(self) -> dict[str, Path]:
        """The files under ``runner.js``'s names (``training``, ``eval``, ``optimizer``, ``checkpoint``)."""
        roles = {"training": self.training, "eval": self.eval, "optimizer": self.optimizer,
                 "checkpoint": self.checkpoint}
        return {role: path for role, path in roles.items() if path is not None}


@dataclass(frozen=True)
class Trained:
    """What one `OrtDevice.train` did: each step's loss, one epoch's examples (FedAvg's weight), wall seconds."""

    losses: list[float]
    examples: int
    seconds: float

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return len(self.losses)

    @property
    def steps_per_second(self) -> float:
        """The loop's rate."""
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


class OrtDevice:
    """One device's ONNX Runtime objects over a device folder's files (build with `open`; `release` frees them)."""

    def __init__(self, state: Any, module: Any, optimizer: Any) -> None:
        self._state, self._module, self._optimizer = state, module, optimizer
        self.parameter_count: int = module.get_parameters_size(False)

    @classmethod
    def open(
        cls, files: DeviceFiles, *, weights: np.ndarray | None = None, checkpoint: Path | None = None,
        evaluation: bool = False, lr: float | None = None, intra_op_threads: int = 1, trainable_only: bool = False,
    ) -> OrtDevice:
        """Open a device on `files`, as ONNX Runtime documents a device that receives its weights.

        Args:
            files: the device folder's files.
            weights: every state tensor as one float32 buffer in the training graph's order; None keeps
                the checkpoint's.
            checkpoint: a checkpoint to open instead of ``files.checkpoint`` (a device's own, with its
                optimizer state).
            evaluation: also load the eval graph.
            lr: the learning rate to set; None leaves the rate the optimizer graph computes or holds.
            intra_op_threads: ONNX Runtime's intra-op threads; 0 for ORT's default pool.
            trainable_only: `weights` hold the trainable parameters alone (the frozen ones stay the checkpoint's).

        Raises:
            ArtifactError: for a file ONNX Runtime cannot load.
            ConfigurationError: for `weights` of another size than the state's.
        """
        source = checkpoint or files.checkpoint
        with refused(f"the checkpoint {source}", "it is damaged, truncated or not an ORT checkpoint"):
            state = CheckpointState.load_checkpoint(os.fspath(source))
        graphs = " and ".join(os.fspath(graph) for graph in (files.training, files.eval if evaluation else None)
                              if graph is not None)
        with refused(f"the graphs {graphs} over {source}", "a graph is damaged or truncated, or another model's"):
            module = Module(os.fspath(files.training), state,
                            os.fspath(files.eval) if evaluation and files.eval is not None else None,
                            device="cpu",
                            session_options=session_options(spinning=False, intra_op_threads=intra_op_threads))
        state_outlives(module, state)
        if weights is not None:
            copy_parameters(module, weights, trainable_only=trainable_only)
        with refused(f"the optimizer graph {files.optimizer}", "it is damaged, truncated or another model's"):
            optimizer = Optimizer(os.fspath(files.optimizer), module)
        if lr is not None:
            optimizer.set_learning_rate(lr)
        return cls(state, module, optimizer)

    def set_weights(self, weights: np.ndarray, *, trainable_only: bool = False) -> None:
        """Replace every (or every trainable) parameter's value, one float32 buffer in the training graph's order.

        Raises:
            ConfigurationError: for a buffer of another dtype or size.
        """
        copy_parameters(self._module, weights, trainable_only=trainable_only)

    def train(self, batches: Sequence[Sequence[Any]], *, epochs: int = 1) -> Trained:
        """Per epoch, per batch: one train step, one optimizer step and a gradient reset.

        Raises:
            ConfigurationError: for `epochs` below 1 or no batches.
        """
        started = time.perf_counter()
        feeds = _feeds(batches, epochs)
        module, step, reset = self._module, self._optimizer.step, self._module.lazy_reset_grad
        module.train()
        losses = []
        for _ in range(epochs):
            for feed in feeds:
                outputs = module(*feed)
                step()
                reset()
                losses.append(float((outputs[0] if isinstance(outputs, tuple) else outputs).numpy().reshape(-1)[0]))
        examples = sum(int(batch[0].shape[0]) for batch in batches)
        return Trained(losses, examples, time.perf_counter() - started)

    def evaluate(self, batches: Sequence[Sequence[Any]]) -> list[tuple[float, np.ndarray | None]]:
        """Per batch, the eval graph's loss and its next output (None without one); needs ``evaluation=True``."""
        module = self._module
        module.eval()
        results = []
        for feed in _feeds(batches, 1):
            outputs = module(*feed)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            results.append((float(outputs[0].numpy().reshape(-1)[0]),
                            outputs[1].numpy() if len(outputs) > 1 else None))
        return results

    def get_weights(self, *, trainable_only: bool = False) -> np.ndarray:
        """Every (or every trainable) parameter's value, in the order `set_weights` takes (a copy)."""
        return self._module.get_contiguous_parameters(trainable_only).numpy().copy()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the device's checkpoint with its optimizer state (step and moments), as a device keeps it."""
        CheckpointState.save_checkpoint(self._state, os.fspath(path), include_optimizer_state=True)
        return Path(path)

    def release(self) -> None:
        """Free ONNX Runtime's objects, the optimizer and the module before their state, and give the memory back."""
        self._optimizer = self._module = None
        self._state = None
        _trim_heap()


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl): nothing to trim
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc()


def _trim_heap() -> None:
    """Return the freed heap to the system (glibc's ``malloc_trim``).

    NOTE: devices that open one after another in one process each load the frozen base (a LoRA
    model's); glibc keeps the freed copies in its arenas, and the process grew by about three of them
    over 100 devices before this (tests/fleet/devices/test_lora_exchange.py).
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _feeds(batches: Sequence[Sequence[Any]], epochs: int) -> list[list[Any]]:
    """Each batch's tensors as ONNX Runtime values, once per round (``runner.js``'s ``toFeeds``); no copy."""
    if epochs < 1:
        raise ConfigurationError(f"Expected `epochs` >= 1, but got {epochs}; pass the local epochs per round.")
    if not batches:
        raise ConfigurationError("Expected at least one batch to train on, but got none; give every device data.")
    return [[onnxruntime.OrtValue.ortvalue_from_numpy(_array(tensor)) for tensor in batch] for batch in batches]


def _array(tensor: Any) -> np.ndarray:
    """A contiguous numpy view of a CPU tensor or array (a copy only where it is not contiguous)."""
    array = tensor.numpy() if hasattr(tensor, "numpy") and not isinstance(tensor, np.ndarray) else tensor
    return np.ascontiguousarray(array)
