"""What the tests share: ONNX Runtime's documented device loop, the quiet Trainer, a probe, skip markers.

- `ort_device_loop` is the independent reference a device folder is held to: ONNX Runtime's own
  Python API (``CheckpointState.load_checkpoint``, ``Module``, ``Optimizer``, ``train_step`` /
  ``optimizer.step()`` / ``lazy_reset_grad()``), on the files themselves, never through the package;
  `ort_device_run` is the same loop, its losses kept too.
- `quiet_trainer` is a real ``Trainer`` with its progress bar, model summary and logger off.
- `GradientProbe` keeps the gradients the first optimizer step applies and every training loss.
- `RunIf` is one ``skipif`` marker for what a test needs of the machine, as Lightning's own tests have.
- `ort_deaths` records the order in which ONNX Runtime frees a C++ Module and its CheckpointState.
- `cli_error_line` is the console script's one error line, what a user's script reads of its stderr.
- `tiered` parametrizes a long list of cases of which the fast tier (``pytest -m "not slow"``) runs a few.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from onnxruntime import OrtValue
from onnxruntime.training.api import CheckpointState, Module, Optimizer

__all__ = ["ROOT", "DeviceRun", "GradientProbe", "RunIf", "checkpointing_for", "cli_error_line", "ort_deaths",
           "ort_device_loop", "ort_device_run", "ort_device_start", "quiet_trainer", "scale_gradient", "tiered"]

Tensor = torch.Tensor | np.ndarray
#: The repository's root: the tests' paths are written from it, wherever a test file lies under tests/.
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- ONNX Runtime's device loop
def graph_file(folder: Path, role: str, *, prefix: str = "", graphs: str | None = None) -> str:
    """The path of a graph: ``{prefix}{role}.{graphs}``; with no `graphs`, the ``.onnx`` where it is, else ``.ort``."""
    if graphs is not None:
        return str(folder / f"{prefix}{role}.{graphs}")
    onnx_path = folder / f"{prefix}{role}.onnx"
    return str(onnx_path if onnx_path.is_file() else folder / f"{prefix}{role}.ort")


def _numpy(tensor: Tensor) -> np.ndarray:
    return tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor


def _buffer(training: str, values: Mapping[str, Tensor] | np.ndarray) -> np.ndarray:
    """Every state tensor in the training graph's input order as ONNX Runtime reports it, one float32 buffer."""
    if isinstance(values, np.ndarray):
        return values
    session = onnxruntime.InferenceSession(training, providers=["CPUExecutionProvider"])
    order = [arg.name for arg in session.get_inputs() if arg.name in values]
    assert sorted(order) == sorted(values), "every state tensor is a training graph input"
    return np.concatenate([_numpy(values[name]).ravel() for name in order]).astype(np.float32)


def ort_device_start(
    folder: Path, *, prefix: str = "", graphs: str | None = None, checkpoint: Path | None = None,
    values: Mapping[str, Tensor] | np.ndarray | None = None, session_options: Any = None,
) -> tuple[CheckpointState, Module, Optimizer]:
    """ONNX Runtime's documented start of a device on `folder`'s files: state, module, optimizer.

    Args:
        folder: the folder of the graphs and the checkpoint.
        prefix: the graphs' and checkpoints' file name prefix.
        graphs: ``"onnx"`` or ``"ort"``; None takes each ``.onnx`` where it is, else the ``.ort``.
        checkpoint: the checkpoint to load; by default ``{prefix}checkpoint``, or with `values`
            ``{prefix}nominal_checkpoint``.
        values: the weights a server sends (by name, or one buffer already in the graph's input
            order), copied in with ``copy_buffer_to_parameters``.
        session_options: the ``SessionOptions`` of ORT's Module; None, ORT's defaults (what a device runs).

    Returns:
        The checkpoint state (its parameters are the module's), the module and the optimizer.
    """
    default = "nominal_checkpoint" if values is not None else "checkpoint"
    state = CheckpointState.load_checkpoint(str(checkpoint or folder / f"{prefix}{default}"))
    training = graph_file(folder, "training_model", prefix=prefix, graphs=graphs)
    module = Module(training, state, graph_file(folder, "eval_model", prefix=prefix, graphs=graphs),
                    session_options=session_options)
    if values is not None:
        # NOTE: ORT 1.19.2's Module.copy_buffer_to_parameters hands its binding the Python OrtValue, which the
        # binding refuses; the binding takes the C-level one.
        # NOTE: `buffer` stays referenced through the call: the C-level OrtValue shares its memory, and only the
        # Python one keeps it alive.
        buffer = OrtValue.ortvalue_from_numpy(_buffer(training, values))
        module._model.copy_buffer_to_parameters(buffer._ortvalue, False)
    optimizer = Optimizer(graph_file(folder, "optimizer_model", prefix=prefix, graphs=graphs), module)
    return state, module, optimizer


#: The weak references `ort_deaths` keeps alive for the life of the test process.
_DEATH_WATCH: list[list[weakref.ref[Any]]] = []


def ort_deaths(module: Module, state: CheckpointState) -> list[str]:
    """The order in which ORT's C++ Module and CheckpointState under these wrappers are freed, as it happens.

    ORT 1.19.2's C++ Module writes into its CheckpointState when it is destroyed (``~Module`` resets
    the state's data-transfer pointer), so a state freed first is written after it is freed: glibc
    then aborts, now or at the process's end (``free(): invalid pointer``). The list must read
    ``["Module", "CheckpointState"]`` once both are gone.

    Example::

        deaths = ort_deaths(module, state)
        del module, state
        assert deaths == ["Module", "CheckpointState"]
    """
    deaths: list[str] = []
    # NOTE: the references must outlive the objects, or their callbacks never run; the list keeps them.
    refs = [weakref.ref(module._model, lambda _: deaths.append("Module")),
            weakref.ref(state._state, lambda _: deaths.append("CheckpointState"))]
    _DEATH_WATCH.append(refs)
    return deaths


@dataclass(frozen=True)
class DeviceRun:
    """What ONNX Runtime's documented loop gave: each step's loss and the parameters after the last step."""

    losses: list[float]
    parameters: dict[str, np.ndarray]


def ort_device_run(folder: Path, batches: Iterable[Sequence[Tensor]], *, lr: float | None,
                   **start: Any) -> DeviceRun:
    """ONNX Runtime's documented training loop on `folder`'s files: its losses and the parameters after it.

    Args:
        folder: the folder of the graphs and the checkpoint.
        batches: each batch's graph inputs, in order (torch tensors or numpy arrays).
        lr: the constant learning rate set on the optimizer; None never sets one (as onnxruntime-web
            cannot), which leaves the rate the optimizer graph holds.
        **start: `ort_device_start`'s options (``prefix``, ``graphs``, ``checkpoint``, ``values``,
            ``session_options``).
    """
    state, module, optimizer = ort_device_start(folder, **start)
    if lr is not None:
        optimizer.set_learning_rate(lr)
    module.train()
    losses = []
    for batch in batches:
        outputs = module(*(_numpy(tensor) for tensor in batch))
        # NOTE: ORT's Module returns its one output alone, several as a sequence; the loss comes first.
        losses.append(float(outputs if isinstance(outputs, np.ndarray) else outputs[0]))
        optimizer.step()
        module.lazy_reset_grad()
    return DeviceRun(losses, {name: np.array(parameter.data) for name, parameter in state.parameters})


def ort_device_loop(folder: Path, batches: Iterable[Sequence[Tensor]], *, lr: float | None,
                    **start: Any) -> dict[str, np.ndarray]:
    """ONNX Runtime's documented training loop on `folder`'s files; the parameters after it (`ort_device_run`)."""
    return ort_device_run(folder, batches, lr=lr, **start).parameters


# ----------------------------------------------------------------------------- the quiet Trainer
def checkpointing_for(options: Mapping[str, object]) -> bool:
    """``enable_checkpointing`` for a test Trainer: on exactly when a callback is a ModelCheckpoint.

    NOTE: ORTCheckpoint is a ModelCheckpoint, which Lightning accepts only with checkpointing enabled;
    without one, the tests keep Lightning's own ``.ckpt`` writer off.
    """
    callbacks = options.get("callbacks") or ()
    return any(isinstance(callback, ModelCheckpoint) for callback in callbacks)  # type: ignore[attr-defined]


def quiet_trainer(**options: Any) -> L.Trainer:
    """A real ``Trainer`` with no progress bar, model summary or logger; `options` override any default.

    Checkpointing is on exactly when a callback is a ``ModelCheckpoint`` (see `checkpointing_for`).
    """
    defaults: dict[str, Any] = dict(
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=checkpointing_for(options),
    )
    return L.Trainer(**{**defaults, **options})


class GradientProbe(Callback):
    """Keeps the gradients the first optimizer step applies (ORT's, as the parameters' ``.grad``) and every loss."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


# ----------------------------------------------------------------------------- skip conditions
def _cuda_reasons(cuda: bool | None, cuda_build: bool | None) -> list[str]:
    gpu = torch.cuda.is_available()
    build = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    reasons = []
    if cuda is True and not (gpu and build):
        reasons.append("needs a CUDA GPU and the CUDA build of onnxruntime-training")
    if cuda is False and gpu:
        reasons.append("for machines where torch sees no CUDA GPU")
    if cuda_build is False and build:
        reasons.append("for an ONNX Runtime build without CUDA")
    return reasons


def _web_reasons(node: bool, chromium: bool) -> list[str]:
    if not (node or chromium):
        return []
    from tests import _web  # NOTE: looks for onnxruntime-web's folder; only the web tests pay for it

    return [reason for wanted, reason in ((node, _web.NODE_MISSING), (chromium, _web.CHROMIUM_MISSING))
            if wanted and reason is not None]


def RunIf(  # noqa: N802 (named as Lightning's own tests name it)
    *, cuda: bool | None = None, cuda_build: bool | None = None, linux: bool = False, fork: bool = False,
    node: bool = False, chromium: bool = False,
) -> pytest.MarkDecorator:
    """One ``skipif`` marker for what a test needs of the machine; its reason names every need that is unmet.

    Args:
        cuda: True, a CUDA GPU torch sees and the CUDA build of ONNX Runtime; False, no CUDA GPU.
        cuda_build: False, an ONNX Runtime build without the CUDA provider.
        linux: Linux (``/proc``, SIGKILL).
        fork: ``os.fork``.
        node: Node.js and onnxruntime-web.
        chromium: Chromium and onnxruntime-web.

    Example::

        @RunIf(cuda=True)
        def test_on_the_gpu() -> None: ...
    """
    reasons = _cuda_reasons(cuda, cuda_build)
    if linux and not sys.platform.startswith("linux"):
        reasons.append("needs Linux")
    if fork and not hasattr(os, "fork"):
        reasons.append("needs os.fork")
    reasons += _web_reasons(node, chromium)
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "never skipped")


# ----------------------------------------------------------------------------- test tiers
def tiered(cases: Sequence[Any], *, ids: Sequence[str], fast: Iterable[str]) -> list[Any]:
    """`cases` as ``pytest.param``s for ``parametrize``: those whose id is in `fast` run in both tiers, the others
    carry ``pytest.mark.slow`` and run only in the full run (``.ci/run``).

    Example::

        @pytest.mark.parametrize("case", tiered(CASES, ids=[case.name for case in CASES], fast={"resnet18"}))
        def test_case(case: Case) -> None: ...
    """
    wanted = set(fast)
    unknown = wanted - set(ids)
    assert not unknown, f"fast ids {sorted(unknown)} name no case"
    return [pytest.param(case, id=name, marks=() if name in wanted else pytest.mark.slow)
            for case, name in zip(cases, ids, strict=True)]


def scale_gradient(path: Path, parameter: str, factor: float) -> None:
    """Multiply one gradient of a training graph by `factor` before it is accumulated (a wrong graph, on purpose)."""
    proto = onnx.load(path)
    grad = f"{parameter}_grad"
    index = next(i for i, node in enumerate(proto.graph.node) if grad in node.input)
    scaled = f"{grad}_tampered"
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.array(factor, dtype=np.float32), "tamper_factor"))
    proto.graph.node.insert(index, onnx.helper.make_node("Mul", [grad, "tamper_factor"], [scaled]))
    accumulator = proto.graph.node[index + 1]
    accumulator.input[list(accumulator.input).index(grad)] = scaled
    onnx.save(proto, path)


# ----------------------------------------------------------------------------- the console script's errors
def cli_error_line(stderr: str) -> str:
    """Return the console script's one error line from a child's stderr, checking the contract.

    The error is the last line and the only one with the ``ort-lightning: error:`` prefix; nothing
    on stderr is a traceback or a usage text. Lines before it may be a library's own, printed as it
    was imported (torch's "No CUDA runtime is found, using CUDA_HOME=..."): the tests accept them.
    """
    from ort_lightning.cli.console import ERROR_PREFIX

    lines = stderr.splitlines()
    assert lines, "nothing on stderr"
    assert stderr.endswith("\n"), stderr[-3000:]
    assert [line for line in lines if line.startswith(ERROR_PREFIX)] == [lines[-1]], stderr[-3000:]
    assert not any(line.startswith(("Traceback", "usage:", "  File ")) for line in lines), stderr[-3000:]
    return lines[-1]
