"""The ORT objects that train one set of artifacts: `assemble` builds a `TrainingSession`.

A CheckpointState, a Module and an Optimizer over that one state, on a device, with the session
options.

Example::

    >>> parse_device("cpu")
    ('cpu', 0)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ort_lightning.errors import ArtifactError, ConfigurationError, DeviceError, ORTLightningError
from ort_lightning.ort._api import (
    CheckpointState,
    Module,
    Optimizer,
    onnxruntime,
)
from ort_lightning.ort._api import capi as _C
from ort_lightning.ort.files import nominal_summary_of, ort_graph_io, summary_of
from ort_lightning.ort.generate import OPTIMIZER_NODES as _OPTIMIZER_NODES
from ort_lightning.ort.generate import optimizer_kind_of
from ort_lightning.ort.graph_files import load_graph
from ort_lightning.ort.options import session_options
from ort_lightning.ort.settings import SessionSettings

__all__ = [
    "HeldState",
    "SessionSettings",
    "OrtValueVector",
    "TrainingSession",
    "assemble",
    "buffer_order",
    "copy_parameters",
    "optimizer_kind_in",
    "parse_device",
    "read_state",
    "refused",
    "session_options",
    "state_outlives",
]

OrtValueVector = _C.OrtValueVector
_CPU = _C.OrtDevice(_C.OrtDevice.cpu(), _C.OrtDevice.default_memory(), 0)

_CUDA_INSTALL = 'pip uninstall -y onnxruntime-training-cpu && pip install "ort-lightning[cuda]"'


#: "cpu", "cuda" or "cuda:N" with ASCII digits; a bare ":" or an index on "cpu" is a typo.
_DEVICE = re.compile(r"(?P<kind>cpu)|(?P<cuda>cuda)(?::(?P<index>[0-9]+))?", re.ASCII)


def parse_device(device: str) -> tuple[str, int]:
    """Split ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a kind and an index, checking the build.

    Raises:
        DeviceError: for another spelling, or for CUDA without the CUDA build of ORT.

    Example::

        >>> parse_device("cpu")
        ('cpu', 0)
    """
    match = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is None:
        raise DeviceError(
            f"Expected a device 'cpu', 'cuda' or 'cuda:N', but got {device!r}; pass one of those spellings."
        )
    kind, index = match.group("kind") or match.group("cuda"), match.group("index")
    if kind == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise DeviceError(
            f"Device {device!r} needs the CUDA build of ONNX Runtime training, but the installed build "
            f"offers {onnxruntime.get_available_providers()}; run `{_CUDA_INSTALL}`, or train on \"cpu\"."
        )
    return kind, int(index or 0)


class TrainingSession:
    """The ORT objects that train one set of artifacts: state, module, optimizer.

    The module and the optimizer share `state`, so an optimizer update is visible to the next
    step at once. Hot-path methods are bound C functions; nothing is looked up per step.
    `optimizer_kind` (``"adamw"`` or ``"sgd"``) is what the optimizer graph itself runs.
    """

    def __init__(
        self, state: Any, module: Any, optimizer: Any, *, settings: SessionSettings, optimizer_kind: str,
    ) -> None:
        #: How this session runs (its device as built: ``"cpu"`` or ``"cuda:N"``).
        self.settings = settings
        self.optimizer_kind = optimizer_kind
        # NOTE: ORT's Optimizer and Module point into the CheckpointState without owning it: `close` (also
        # when the wrapper is dropped, `__del__`) releases them before the state.
        self._state = state
        self._module = module
        self._optimizer = optimizer
        self._train = module._model.train_step_with_ort_values
        self._eval = module._model.eval_step_with_ort_values
        self.lazy_reset_grad = module._model.lazy_reset_grad
        if optimizer is None:  # a folder without an optimizer graph: evaluation and prediction only
            self.optimizer_step = self.set_lr = _no_optimizer
            self.get_lr: Callable[[], float] = _no_learning_rate
            return
        self.optimizer_step = optimizer._optimizer.optimizer_step
        self.set_lr = optimizer._optimizer.set_learning_rate
        self.get_lr = optimizer._optimizer.get_learning_rate

    @property
    def device(self) -> str:
        """Where ORT runs: ``"cpu"`` or ``"cuda:N"``."""
        return self.settings.device

    @property
    def spinning(self) -> bool:
        """Whether ORT's worker threads spin between steps."""
        return self.settings.spinning

    @property
    def intra_op_threads(self) -> int:
        """The size of ORT's intra-op pool; 0 for ORT's default."""
        return self.settings.intra_op_threads

    @property
    def evaluation(self) -> bool:
        """Whether ORT's Module holds the eval graph (a session built for training alone does not)."""
        return self.settings.evaluation

    def train_step(self, inputs: Any) -> Any:
        """Run forward and backward; gradients are added to ORT's buffers. Returns the fetches."""
        # NOTE: a fresh fetch vector per step; a reused one makes ORT overwrite the previous
        # step's outputs in place, under tensors Lightning may still hold.
        fetches = OrtValueVector()
        self._train(inputs, fetches)
        return fetches

    def eval_step(self, inputs: Any) -> Any:
        """Run the eval graph. Returns the fetches."""
        fetches = OrtValueVector()
        self._eval(inputs, fetches)
        return fetches

    def parameters(self) -> list[tuple[str, Any, Any | None, bool]]:
        """Return ``(name, data, grad or None, requires_grad)`` OrtValues of the checkpoint state."""
        result = []
        for name in self._state._state.parameter_names():
            parameter = self._state._state.get_parameter(name)
            grad = parameter.grad if parameter.requires_grad and parameter.grad.has_value() else None
            result.append((name, parameter.data, grad, bool(parameter.requires_grad)))
        return result

    def input_names(self, *, training: bool = True) -> list[str]:
        """Return the user inputs of the training (or eval) graph, in order."""
        return list(self._module._model.input_names(training))

    def output_names(self, *, training: bool = True) -> list[str]:
        """Return the outputs of the training (or eval) graph, in order."""
        return list(self._module._model.output_names(training))

    def save(self, path: os.PathLike[str] | str, *, include_optimizer_state: bool) -> None:
        """Write the CheckpointState (and optionally the optimizer's step and moments) to `path`."""
        _C.save_checkpoint(self._state._state, os.fspath(path), include_optimizer_state)

    def set_properties(self, properties: Mapping[str, int | float | str]) -> None:
        """Store int, float or str properties in the CheckpointState (saved with it)."""
        state = self._state._state
        for name, value in properties.items():
            state.add_property(name, value)

    def properties(self) -> dict[str, Any]:
        """The properties the CheckpointState holds (those it was loaded with, and those set since)."""
        state = self._state._state
        return {name: state.get_property(name) for name in state.property_names()}

    def export_for_inferencing(self, path: os.PathLike[str] | str, outputs: Sequence[str]) -> None:
        """Write the eval graph with the current parameters as an inference model producing `outputs`."""
        self._module._model.export_model_for_inferencing(os.fspath(path), list(outputs))

    @property
    def ort_objects(self) -> tuple[Any, Any, Any]:
        """ONNX Runtime's own ``(CheckpointState, Module, Optimizer)`` of this session (Nones once closed).

        For ONNX Runtime's own API on the same objects (its ``LinearLRScheduler``, its documented loop);
        the session's methods are the way to train them.
        """
        return self._state, self._module, self._optimizer

    def handover(self) -> HeldState:
        """This session's CheckpointState, for the next build (`assemble(checkpoint=...)`); the caller then closes it.

        `LiveSession` closes the running session before it builds over the state. The weights, the
        optimizer's step and moments and the properties go over as they are: no file is written and
        nothing is copied (ORT's Optimizer takes the moments it finds in the state), so that a
        rebuild for other thread settings or graphs costs no snapshot's memory.
        """
        return HeldState(self._state, self.settings.device)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Let ONNX Runtime free these objects now (their sessions, kernels and memory arena).

        What still holds this wrapper (an optimizer, the step path) no longer holds ORT's objects, so
        that a rebuild can free the old session before it builds the new one: one session's memory at
        a time. Tensors already handed out (parameter views, outputs) keep their own memory. Every
        step method raises afterwards.
        """
        # NOTE: ORT's Optimizer and Module point into the CheckpointState without owning it: they go first, the
        # state last (the bound methods hold the C++ objects, so they go before the wrappers).
        self.optimizer_step = self.set_lr = self.get_lr = _closed
        self._optimizer = None
        self._train = self._eval = self.lazy_reset_grad = _closed
        self._module = None
        self._state = None



def _no_optimizer(*_: Any) -> None:
    raise ConfigurationError(
        "These artifacts have no optimizer graph (generate_artifacts(..., optimizer=None)), so they can "
        "evaluate and predict but not train; regenerate them with an optimizer, or pass "
        "ORTLightningModule(..., optimizer=lambda params: torch.optim.SGD(params, lr=...))."
    )


def _no_learning_rate() -> float:
    return 0.0


def _closed(*_: Any) -> Any:
    raise ConfigurationError(
        "This ORT session was closed: the module rebuilt its session (another device, thread setting, checkpoint "
        "or a fresh optimizer state) and freed this one; use module.ort_session, the running one, instead of a "
        "session kept from before."
    )


@dataclass(frozen=True)
class HeldState:
    """ORT's CheckpointState in memory, on its way to one build (`assemble(checkpoint=...)`).

    Either a closed session's, for the next build on the same `device` (see `TrainingSession.handover`),
    or one read from the file `source` (`read_state`), whose summary is then read from the same read.
    """

    state: Any
    device: str | None = None
    source: str | None = None

    def summary(self) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, Any]]:
        """``(name, shape, requires_grad)`` per parameter, and the properties.

        Raises:
            RuntimeError: (one of ``CHECKPOINT_READ_ERRORS``) for a nominal state.
        """
        return summary_of(self.state)

    def nominal_summary(self) -> tuple[list[str], dict[str, Any]] | None:
        """The parameter names and properties of a nominal state; None for a state that holds weights."""
        return nominal_summary_of(self.state)


def read_state(path: os.PathLike[str] | str) -> HeldState:
    """Read an ORT checkpoint file once: its summary and the build it starts come from this one read.

    Raises:
        RuntimeError: (one of ``CHECKPOINT_READ_ERRORS``) for a file ONNX Runtime cannot read.
    """
    source = os.fspath(path)
    return HeldState(CheckpointState.load_checkpoint(source), source=source)


def assemble(
    *,
    training_model: os.PathLike[str] | str,
    eval_model: os.PathLike[str] | str | None,
    optimizer_model: os.PathLike[str] | str | None,
    checkpoint: os.PathLike[str] | str | HeldState,
    settings: SessionSettings | None = None,
    parameters: np.ndarray | None = None,
    optimizer_kind: str | None = None,
) -> TrainingSession:
    """Build CheckpointState -> Module (train + eval) -> [the weights in] -> Optimizer as `settings` say.

    `settings` None is `SessionSettings()`: the CPU, spinning threads, ORT's own pool size, the eval graph.

    The eval graph is built only when ``settings.evaluation`` (without it, one session fewer: a
    device's round). `checkpoint` is a file, or a `HeldState` handed over by a running session on
    the same device.

    ``settings.spinning`` is ORT's intra-op thread spinning, ``settings.intra_op_threads`` the size
    of its intra-op pool, 0 for ORT's default (see `session_options`). `parameters` is every state
    tensor in one float32 buffer, in the training graph's input order; when given, it replaces the
    checkpoint's weights before the Optimizer is built, which is how a device starts from a nominal
    checkpoint (names and shapes, no weights): ONNX Runtime's documented sequence
    ``load_checkpoint(nominal)``, ``Module(...)``, ``copy_buffer_to_parameters(buffer, trainable_only=False)``.

    `optimizer_kind` is what the optimizer graph runs, as its caller read it from the graph's nodes
    (`optimizer_kind_in`); None reads it here. It names what ORT will actually run, not what a
    manifest says.

    Raises:
        DeviceError: for a device this build cannot use.
        ArtifactError: for an optimizer graph that is neither AdamW nor SGD.
        ConfigurationError: for a `custom_op_library` that is missing or cannot be loaded, or
            `parameters` of another size than the state's.
    """
    settings = SessionSettings() if settings is None else settings
    kind, index = parse_device(settings.device)
    options = session_options(settings.custom_op_library, spinning=settings.spinning,
                              intra_op_threads=settings.intra_op_threads)
    target = f"{kind}:{index}" if kind == "cuda" else "cpu"
    if optimizer_kind is None:
        optimizer_kind = "none" if optimizer_model is None else optimizer_kind_in(optimizer_model)
    eval_graph = eval_model if settings.evaluation else None
    if isinstance(checkpoint, HeldState):
        state, source = checkpoint.state, checkpoint.source or "the running session's state"
    else:
        source = os.fspath(checkpoint)
        with refused(f"the checkpoint {source}", "it is damaged, truncated or not an ORT checkpoint"):
            state = CheckpointState.load_checkpoint(source)
    named = " and ".join(os.fspath(graph) for graph in (training_model, eval_graph) if graph is not None)
    graphs = f"the graphs {named} over {source}"
    with refused(graphs, "a graph is damaged or truncated, or a file is another model's"):
        module = Module(
            os.fspath(training_model),
            state,
            None if eval_graph is None else os.fspath(eval_graph),
            device=target,
            session_options=options,
        )
    state_outlives(module, state)
    if parameters is not None:
        copy_parameters(module, parameters)
    optimizer = None
    if optimizer_model is not None:
        optimizer_graph = f"the optimizer graph {os.fspath(optimizer_model)}"
        with refused(optimizer_graph, "it is damaged, truncated or another model's"):
            optimizer = Optimizer(os.fspath(optimizer_model), module)
    built = dataclasses.replace(settings, device=target, evaluation=eval_graph is not None)
    return TrainingSession(state, module, optimizer, settings=built, optimizer_kind=optimizer_kind)


def state_outlives(module: Module, state: CheckpointState) -> None:
    """Keep `state` alive until ORT's C++ Module under `module` is destroyed, whoever holds that Module last.

    ORT 1.19.2's C++ Module writes into its CheckpointState when it is destroyed (``~Module`` resets
    the state's data-transfer pointer), and a bound call (``module._model.train_step_with_ort_values``)
    keeps that Module alive past the Python ``Module``, which holds the state. Freed in that order,
    the state is written after it is freed: glibc then aborts, at once or at the process's end.

    Example::

        module = Module(training_model, state, eval_model, device=target, session_options=options)
        state_outlives(module, state)  # before anything can take a bound call of it
    """
    # NOTE: finalize holds `state` until the Module's weak reference dies, after the Module's destructor. Not at
    # exit: a Module still alive then keeps its state.
    weakref.finalize(module._model, _release, state).atexit = False


def _release(_: CheckpointState) -> None:
    """Nothing: the call only ends the finalizer's hold on its argument."""


#: What ONNX Runtime raises for a file it cannot load (its C++ errors arrive as RuntimeError or these).
_LOAD_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, _C.Fail, _C.InvalidArgument, _C.InvalidGraph, _C.InvalidProtobuf, _C.NoSuchFile,
)


@contextlib.contextmanager
def refused(what: str, likely: str) -> Iterator[None]:
    """Turn ONNX Runtime's refusal to load `what` into an `ArtifactError` that names it and what to do."""
    try:
        yield
    except _LOAD_ERRORS as error:
        if isinstance(error, ORTLightningError):
            raise
        raise ArtifactError(
            f"ONNX Runtime cannot load {what} ({' '.join(str(error).split())[-240:]}); {likely}. Copy the artifacts "
            "again from where they were exported, or re-export them with export_artifacts()."
        ) from error


def copy_parameters(module: Any, parameters: np.ndarray) -> None:
    """Copy one float32 buffer into every parameter of `module`'s state, in the training graph's input order.

    Works on a nominal state too: ONNX Runtime allocates the parameters then.

    Raises:
        ConfigurationError: for a buffer that is not float32 or not the size of the state.
    """
    expected = module.get_parameters_size(False)
    if parameters.dtype != np.float32 or parameters.ndim != 1 or parameters.size != expected:
        raise ConfigurationError(
            f"Expected the parameters as one float32 buffer of {expected} values, but got {parameters.dtype} of shape "
            f"{parameters.shape}; pass a value for every state tensor of these artifacts."
        )
    # NOTE: the C-level OrtValue shares the array's memory without keeping it alive: `values` stays referenced
    # until the copy is done (a strided `parameters` is copied into it first).
    values = np.ascontiguousarray(parameters)
    buffer = _C.OrtValue.ortvalue_from_numpy(values, _CPU)
    # NOTE: the 1.19.2 wrapper (Module.copy_buffer_to_parameters) hands the binding its Python
    # OrtValue, which the binding refuses; the binding itself takes the C-level one.
    module._model.copy_buffer_to_parameters(buffer, False)


def buffer_order(training_model: os.PathLike[str] | str, checkpoint: os.PathLike[str] | str) -> list[str]:
    """The state's names in the order of ONNX Runtime's contiguous parameter buffer, as ORT itself lays it out.

    Measured, not assumed: a buffer ``0, 1, 2, ...`` goes in through `copy_parameters`, and each
    parameter's first value then says where its values start.

    Args:
        training_model: the training graph (``.onnx`` or ``.ort``).
        checkpoint: its checkpoint, complete or nominal.
    """
    state = CheckpointState.load_checkpoint(os.fspath(checkpoint))
    module = Module(os.fspath(training_model), state, None, "cpu", session_options=session_options())
    state_outlives(module, state)
    # NOTE: float32 holds every offset below 2**24 exactly; above, rounding keeps the starts in order.
    copy_parameters(module, np.arange(module.get_parameters_size(False), dtype=np.float32))
    names = state._state.parameter_names()
    starts = {name: float(np.asarray(state._state.get_parameter(name).data.numpy()).ravel()[:1].sum())
              for name in names}
    return sorted(names, key=lambda name: starts[name])


def optimizer_kind_in(optimizer_model: os.PathLike[str] | str) -> str:
    """Read ``"adamw"`` or ``"sgd"`` from an optimizer graph (``.onnx`` or ``.ort``).

    Raises:
        ArtifactError: for a graph with neither optimizer node.
    """
    nodes = _optimizer_nodes(os.fspath(optimizer_model))
    kind = optimizer_kind_of(nodes)
    if kind is None:
        raise ArtifactError(
            f"Optimizer graph {os.fspath(optimizer_model)} has nodes {sorted(set(nodes))} but no "
            f"{' or '.join(_OPTIMIZER_NODES)} node; re-export the artifacts with "
            "export_artifacts(..., optimizer='adamw' or 'sgd')."
        )
    return kind


def _optimizer_nodes(path: str) -> list[str]:
    """Node types of an optimizer graph; for an ``.ort`` graph, what its inputs and operator list say."""
    if not path.endswith(".ort"):
        advice = ("it is damaged or truncated: copy the artifacts again from where they were exported, or re-export "
                  "them with export_artifacts()")
        return [node.op_type for node in load_graph(path, advice=advice).graph.node]
    config = path[: -len(".ort")] + ".required_operators.config"
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as stream:
                return [op for line in stream if not line.startswith("#")
                        for op in line.strip().split(";")[-1].split(",")]
        except UnicodeDecodeError as error:
            raise ArtifactError(
                f"{config} is not UTF-8 text ({error.reason} at byte {error.start}), so it is not the operator list "
                f"that ONNX Runtime's converter wrote beside {os.path.basename(path)}; copy it again from where the "
                "artifacts were exported, or delete it (the optimizer kind is then read from the graph's inputs)."
            ) from error
    # NOTE: without the operator list, the inputs tell: only AdamW keeps second-order moments.
    inputs, _ = ort_graph_io(path)
    return ["AdamWOptimizer" if any(name == "second_order_moments" for name, _, _ in inputs) else "SGDOptimizerV2"]
