"""The ORT objects that train one set of artifacts: `assemble` builds a `TrainingSession`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ort_lightning.errors import ArtifactError, ConfigurationError, CudaError, ORTLightningError
from ort_lightning.ort._api import (
    CheckpointState,
    Module,
    Optimizer,
    bound_module,
    bound_optimizer,
    bound_state,
    onnxruntime,
)
from ort_lightning.ort._api import capi as _C
from ort_lightning.ort.checkpoint_state import HeldState, copy_parameters, state_outlives
from ort_lightning.ort.options import session_options
from ort_lightning.ort.ort_files import optimizer_kind_in
from ort_lightning.ort.properties import replace_properties
from ort_lightning.ort.settings import SessionSettings

__all__ = [
    "OrtValueVector",
    "SessionSettings",
    "TrainingSession",
    "assemble",
    "parse_device",
    "refused",
]

OrtValueVector = _C.OrtValueVector

_CUDA_INSTALL = 'pip uninstall -y onnxruntime-training-cpu && pip install "ort-lightning[cuda]"'


#: "cpu", "cuda" or "cuda:N" with ASCII digits; a bare ":" or an index on "cpu" is a typo.
_DEVICE = re.compile(r"(?P<kind>cpu)|(?P<cuda>cuda)(?::(?P<index>[0-9]+))?", re.ASCII)


def parse_device(device: str) -> tuple[str, int]:
    """Split ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a kind and an index, checking the build.

    Raises:
        CudaError: for another spelling, or for CUDA without the CUDA build of ORT.

    Example::

        >>> parse_device("cpu")
        ('cpu', 0)
    """
    match = _DEVICE.fullmatch(device) if isinstance(device, str) else None
    if match is None:
        raise CudaError(
            f"Expected a device 'cpu', 'cuda' or 'cuda:N', but got {device!r}; pass one of those spellings."
        )
    kind, index = match.group("kind") or match.group("cuda"), match.group("index")
    if kind == "cuda" and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise CudaError(
            f"Device {device!r} needs the CUDA build of ONNX Runtime training, but the installed build "
            f"offers {onnxruntime.get_available_providers()}; run `{_CUDA_INSTALL}`, or train on \"cpu\"."
        )
    return kind, int(index or 0)


class TrainingSession:
    """The ORT objects that train one set of artifacts: state, module and optimizer over one state.

    Hot-path methods are bound C functions; nothing is looked up per step.
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
        model = bound_module(module)
        self._train = model.train_step_with_ort_values
        self._eval = model.eval_step_with_ort_values
        self.lazy_reset_grad = model.lazy_reset_grad
        if optimizer is None:  # a folder without an optimizer graph: evaluation and prediction only
            self.optimizer_step = self.set_lr = _no_optimizer
            self.get_lr: Callable[[], float] = _no_learning_rate
            return
        update = bound_optimizer(optimizer)
        self.optimizer_step = update.optimizer_step
        self.set_lr = update.set_learning_rate
        self.get_lr = update.get_learning_rate

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
        state = bound_state(self._state)
        for name in state.parameter_names():
            parameter = state.get_parameter(name)
            grad = parameter.grad if parameter.requires_grad and parameter.grad.has_value() else None
            result.append((name, parameter.data, grad, bool(parameter.requires_grad)))
        return result

    def input_names(self, *, training: bool = True) -> list[str]:
        """Return the user inputs of the training (or eval) graph, in order."""
        return list(bound_module(self._module).input_names(training))

    def output_names(self, *, training: bool = True) -> list[str]:
        """Return the outputs of the training (or eval) graph, in order."""
        return list(bound_module(self._module).output_names(training))

    def save(
        self, path: os.PathLike[str] | str, *, include_optimizer_state: bool,
        properties: Mapping[str, int | float | str] | None = None,
    ) -> None:
        """Write the CheckpointState (with the optimizer's step and moments if asked) to `path`.

        `properties` are the file's exactly; None keeps what the state holds (a snapshot to rebuild from).
        """
        state = bound_state(self._state)
        if properties and not state.property_names():
            # NOTE: ORT writes a property bag only for a state that holds a property; the file's is replaced below.
            name, value = next(iter(properties.items()))
            state.add_property(name, value)
        _C.save_checkpoint(state, os.fspath(path), include_optimizer_state)
        if properties is not None:
            replace_properties(path, properties)

    def properties(self) -> dict[str, Any]:
        """The properties the CheckpointState holds (those it was loaded with, and those a save added)."""
        state = bound_state(self._state)
        return {name: state.get_property(name) for name in state.property_names()}

    def export_for_inferencing(self, path: os.PathLike[str] | str, outputs: Sequence[str]) -> None:
        """Write the eval graph with the current parameters as an inference model producing `outputs`."""
        bound_module(self._module).export_model_for_inferencing(os.fspath(path), list(outputs))

    @property
    def ort_objects(self) -> tuple[Any, Any, Any]:
        """ONNX Runtime's own ``(CheckpointState, Module, Optimizer)`` of this session (Nones once closed)."""
        return self._state, self._module, self._optimizer

    def handover(self) -> HeldState:
        """This session's CheckpointState for the next build, as it is (no file); the caller closes this one."""
        return HeldState(self._state, self.settings.device)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Let ONNX Runtime free these objects now, so that a rebuild holds one session's memory at a time."""
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

    `checkpoint` is a file or a `HeldState`; `parameters`, every state tensor in one float32 buffer,
    replaces the checkpoint's weights before the Optimizer is built (ORT's documented sequence for a
    device that starts from a nominal checkpoint). `optimizer_kind` None reads it from the graph.

    Raises:
        CudaError: for a device this build cannot use.
        ArtifactError: for an optimizer graph that is neither AdamW nor SGD.
        ConfigurationError: for a `custom_op_library` that cannot be loaded, or `parameters` of
            another size than the state's.
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


