"""The one module that imports ONNX Runtime's training API.

Everything else in the package goes through the small surface below, so that an ORT upgrade
(or its absence) is this file's business alone.

Example::

    >>> from ort_lightning.ort import runtime as _ort
    >>> _ort.parse_device("cpu")
    ('cpu', 0)
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx

from ort_lightning.errors import ArtifactError, ConfigurationError, DeviceError, ExportError

_INSTALL_HINT = (
    "ort-lightning needs ONNX Runtime's training package (onnxruntime-training 1.19.2). Install one of:\n"
    '  pip install "ort-lightning[cpu]"   # onnxruntime-training-cpu==1.19.2\n'
    '  pip install "ort-lightning[cuda]"  # onnxruntime-training==1.19.2 (CUDA build, Python 3.10-3.11 only)\n'
    "Install exactly one, and never beside plain `onnxruntime`: all three provide the same package."
)

# NOTE: importing onnxruntime runs logging.basicConfig(level=INFO) (its quantization package
# does), which would print every library's INFO records, Lightning's included, twice; the
# root logger is given back as the user had it.
_root_logger = logging.getLogger()
_root_handlers, _root_level = list(_root_logger.handlers), _root_logger.level
try:
    import onnxruntime
    from onnxruntime.capi import _pybind_state as _C
    from onnxruntime.tools import convert_onnx_models_to_ort as _converter
    from onnxruntime.training import artifacts as _artifacts
    from onnxruntime.training import onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    from onnxruntime.training.onnxblock import _training_graph_utils
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(_INSTALL_HINT) from error
finally:
    _root_logger.handlers[:] = _root_handlers
    _root_logger.setLevel(_root_level)

__all__ = [
    "OrtValue",
    "OrtValueVector",
    "TrainingSession",
    "assemble",
    "generate",
    "is_block",
    "optimizer_kind_in",
    "optimizer_kind_of",
    "ort_graph_io",
    "parse_device",
    "set_seed",
    "versions",
    "write_device_files",
]

OrtValue = _C.OrtValue
OrtValueVector = _C.OrtValueVector

# NOTE: this build logs at INFO by default; ERROR keeps a user's console readable.
_SEVERITY_ERROR = 3
onnxruntime.set_default_logger_severity(_SEVERITY_ERROR)

#: Loss name -> onnxblock class; each adds a label input: ``labels`` (cross-entropy) or ``target``.
_LOSSES = {
    "cross_entropy": onnxblock.loss.CrossEntropyLoss,
    "mse": onnxblock.loss.MSELoss,
    "bce_with_logits": onnxblock.loss.BCEWithLogitsLoss,
    "l1": onnxblock.loss.L1Loss,
}

_CUDA_INSTALL = 'pip uninstall -y onnxruntime-training-cpu && pip install "ort-lightning[cuda]"'

#: "cpu", "cuda" or "cuda:N" with ASCII digits; a bare ":" or an index on "cpu" is a typo.
_DEVICE = re.compile(r"(?P<kind>cpu)|(?P<cuda>cuda)(?::(?P<index>[0-9]+))?", re.ASCII)

#: Optimizer graph node -> the optimizer kind used in the manifest.
_OPTIMIZER_NODES = {"AdamWOptimizer": "adamw", "SGDOptimizerV2": "sgd"}


#: Seed ONNX Runtime's process-wide random generators (Dropout's among them); ORT's own function,
#: called before every training step, so no wrapper runs there.
set_seed: Callable[[int], None] = onnxruntime.set_seed


def versions() -> dict[str, str]:
    """Return the ONNX Runtime version, for the manifest."""
    return {"onnxruntime": onnxruntime.__version__}


def session_options(
    custom_op_library: os.PathLike[str] | str | None = None, *, spinning: bool = True, intra_op_threads: int = 0
) -> Any:
    """Return `SessionOptions` that log errors only, with `custom_op_library` registered when given.

    Nothing is loaded unless the caller names a library: never implicitly from an artifacts folder.
    ``spinning=False`` makes ORT's idle intra-op threads sleep instead of spinning, which pays when
    several processes share the cores (DDP ranks on one CPU), or when torch runs right after ORT.
    ``intra_op_threads`` sizes ORT's intra-op pool; 0 leaves ORT's own default.

    Raises:
        ConfigurationError: for a library file that is missing or that ORT cannot load.
    """
    options = _C.SessionOptions()
    options.log_severity_level = _SEVERITY_ERROR
    options.intra_op_num_threads = intra_op_threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if custom_op_library is not None:
        _register_custom_ops(options, os.fspath(custom_op_library))
    return options


def _register_custom_ops(options: Any, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigurationError(
            f"custom_op_library {path!r} does not exist or is not a file; pass the path of the shared library "
            "(.so/.dll/.dylib) that implements the graph's custom operators, or None."
        )
    try:
        options.register_custom_ops_library(path)
    except (RuntimeError, _C.Fail) as error:
        raise ConfigurationError(
            f"ONNX Runtime cannot load custom_op_library {path!r} ({' '.join(str(error).split())[:200]}); pass a "
            "shared library built against onnxruntime 1.19.2 for this platform, or None."
        ) from error


@contextlib.contextmanager
def _quiet_graph_builder() -> Iterator[None]:
    # NOTE: the gradient builder makes its own SessionOptions, whose session logger ignores the
    # default severity; swapping the factory for the duration of one build is the only knob.
    original = _training_graph_utils.SessionOptions
    _training_graph_utils.SessionOptions = session_options
    try:
        yield
    finally:
        _training_graph_utils.SessionOptions = original


def is_block(obj: object) -> bool:
    """Tell whether `obj` is an `onnxblock.Block` (a custom loss)."""
    return isinstance(obj, onnxblock.Block)


class _GraphLoss(onnxblock.Block):
    """Adapts a function ``(model, output) -> loss name`` that edits the graph to ORT's Block."""

    def __init__(self, build: Callable[[onnx.ModelProto, str], str]) -> None:
        super().__init__()
        self._build = build

    def build(self, output: str) -> str:
        return self._build(self.base, output)


def _loss_block(loss: str | Any | None) -> Any:
    if loss is None:
        return None
    if is_block(loss):
        return loss
    if callable(loss):
        return _GraphLoss(loss)
    return _LOSSES[loss]()


def _optimizer_block(kind: str, options: dict[str, Any]) -> Any:
    if kind == "sgd":
        return onnxblock.optim.SGD()
    return onnxblock.optim.AdamW(
        betas=tuple(options["betas"]), eps=options["eps"], weight_decay=options["weight_decay"]
    )


def generate(
    model: Any,
    *,
    trainable: Sequence[str],
    frozen: Sequence[str],
    loss: str | Any | None,
    optimizer: str,
    optimizer_options: dict[str, Any],
    directory: os.PathLike[str] | str,
    extra_outputs: Sequence[str],
    loss_inputs: Sequence[str] | None,
) -> None:
    """Write training, eval and optimizer graphs and the checkpoint with ORT's generator.

    Args:
        model: the forward `onnx.ModelProto`, parameters as initializers.
        trainable: initializers that get gradients.
        frozen: initializers kept in the checkpoint state without gradients.
        loss: a loss name, an `onnxblock.Block`, a function ``(model, output) -> loss name`` that
            appends the loss to the forward graph, or None when the model's first output is the loss.
        optimizer: ``"adamw"`` or ``"sgd"``.
        optimizer_options: the normalized hyper-parameters of `optimizer`.
        directory: where the four artifacts go.
        extra_outputs: model outputs kept as graph outputs next to the loss.
        loss_inputs: model outputs fed to the loss (None: all of them).

    Raises:
        ExportError: when ORT cannot build the gradient graph.
    """
    loss_block = _loss_block(loss)
    try:
        with _quiet_graph_builder():
            _artifacts.generate_artifacts(
                model,
                requires_grad=list(trainable),
                frozen_params=list(frozen),
                loss=loss_block,
                optimizer=_optimizer_block(optimizer, optimizer_options),
                artifact_directory=os.fspath(directory),
                additional_output_names=list(extra_outputs) or None,
                loss_input_names=list(loss_inputs) if loss_inputs else None,
            )
    except (RuntimeError, _C.Fail, _C.InvalidArgument, _C.InvalidGraph) as error:
        raise ExportError(
            f"ONNX Runtime could not build training graphs for this model: {error}. Check that every "
            "operator is differentiable by ORT 1.19.2 and that `loss` matches the model's outputs."
        ) from error


def write_device_files(
    folder: os.PathLike[str] | str,
    graphs: Sequence[os.PathLike[str] | str],
    checkpoint: os.PathLike[str] | str,
    *,
    ort_format: bool,
    nominal_checkpoint: bool,
) -> None:
    """Write what ``generate_artifacts(..., ort_format=True, nominal_checkpoint=True)`` writes, from final graphs.

    ``.ort`` graphs (and ``*.required_operators.config``) beside the `graphs`, as ORT's generator
    converts them (fixed optimization style); ``nominal_checkpoint`` beside `checkpoint`: its
    parameters' names, shapes and trainability, no weights.
    """
    if ort_format:
        # NOTE: the converter prints its progress; a library keeps the user's console quiet.
        with contextlib.redirect_stdout(io.StringIO()), _quiet_graph_builder():
            for graph in graphs:
                _converter.convert_onnx_models_to_ort(
                    Path(graph), output_dir=Path(folder), optimization_styles=[_converter.OptimizationStyle.Fixed]
                )
    if nominal_checkpoint:
        state = CheckpointState.load_checkpoint(os.fspath(checkpoint))._state
        trainable: list[bytes] = []
        frozen: list[bytes] = []
        for name in state.parameter_names():
            parameter = state.get_parameter(name)
            tensor = onnx.numpy_helper.from_array(parameter.data.numpy(), name)
            (trainable if parameter.requires_grad else frozen).append(tensor.SerializeToString())
        _C.save_checkpoint(trainable, frozen, os.fspath(Path(folder) / "nominal_checkpoint"), True)


def optimizer_kind_of(nodes: Sequence[str]) -> str | None:
    """Map the node types of an optimizer graph to ``"adamw"``, ``"sgd"`` or None.

    Example::

        >>> optimizer_kind_of(["AdamWOptimizer"])
        'adamw'
    """
    for op_type in nodes:
        if op_type in _OPTIMIZER_NODES:
            return _OPTIMIZER_NODES[op_type]
    return None


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
        self, state: Any, module: Any, optimizer: Any, device: str, *, optimizer_kind: str, spinning: bool = True,
        intra_op_threads: int = 0,
    ) -> None:
        self.device = device
        self.optimizer_kind = optimizer_kind
        self.spinning = spinning
        self.intra_op_threads = intra_op_threads
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

    @property
    def has_optimizer(self) -> bool:
        """Whether the artifacts had an optimizer graph (without one, the session only evaluates)."""
        return self._optimizer is not None

    def linear_scheduler(self, *, warmup_steps: int, total_steps: int, lr: float) -> Any:
        """Create ORT's LinearLRScheduler; its lr applies to the optimizer at once.

        Returns an object whose ``scheduler_step()`` recomputes the lr from the optimizer's step.
        """
        # NOTE: the 1.19.2 Python wrapper passes (warmup, total) to a C binding that takes
        # (total, warmup); calling the binding directly with the right order avoids the swap.
        return _C.LinearLRScheduler(self._optimizer._optimizer, total_steps, warmup_steps, lr)


def _no_optimizer(*_: Any) -> None:
    raise ConfigurationError(
        "These artifacts have no optimizer graph (generate_artifacts(..., optimizer=None)), so they can "
        "evaluate and predict but not train; regenerate them with an optimizer, or pass "
        "ORTLightningModule(..., optimizer=lambda params: torch.optim.SGD(params, lr=...))."
    )


def _no_learning_rate() -> float:
    return 0.0


def assemble(
    *,
    training_model: os.PathLike[str] | str,
    eval_model: os.PathLike[str] | str,
    optimizer_model: os.PathLike[str] | str | None,
    checkpoint: os.PathLike[str] | str,
    device: str = "cpu",
    custom_op_library: os.PathLike[str] | str | None = None,
    spinning: bool = True,
    intra_op_threads: int = 0,
) -> TrainingSession:
    """Build CheckpointState -> Module (train + eval) -> Optimizer on `device`.

    `spinning` is ORT's intra-op thread spinning, `intra_op_threads` the size of its intra-op
    pool, 0 for ORT's default (see `session_options`).

    The optimizer kind is read from the optimizer graph's nodes, not from a manifest, so that it
    names what ORT will actually run.

    Raises:
        DeviceError: for a device this build cannot use.
        ArtifactError: for an optimizer graph that is neither AdamW nor SGD.
        ConfigurationError: for a `custom_op_library` that is missing or cannot be loaded.
    """
    kind, index = parse_device(device)
    options = session_options(custom_op_library, spinning=spinning, intra_op_threads=intra_op_threads)
    target = f"{kind}:{index}" if kind == "cuda" else "cpu"
    optimizer_kind = "none" if optimizer_model is None else optimizer_kind_in(optimizer_model)
    state = CheckpointState.load_checkpoint(os.fspath(checkpoint))
    module = Module(
        os.fspath(training_model),
        state,
        os.fspath(eval_model),
        device=target,
        session_options=options,
    )
    optimizer = None if optimizer_model is None else Optimizer(os.fspath(optimizer_model), module)
    return TrainingSession(
        state, module, optimizer, device=target, optimizer_kind=optimizer_kind, spinning=spinning,
        intra_op_threads=intra_op_threads,
    )


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
        return [node.op_type for node in onnx.load(path, load_external_data=False).graph.node]
    config = path[: -len(".ort")] + ".required_operators.config"
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as stream:
            return [op for line in stream if not line.startswith("#") for op in line.strip().split(";")[-1].split(",")]
    # NOTE: without the operator list, the inputs tell: only AdamW keeps second-order moments.
    inputs, _ = ort_graph_io(path)
    return ["AdamWOptimizer" if any(name == "second_order_moments" for name, _, _ in inputs) else "SGDOptimizerV2"]


def ort_graph_io(path: os.PathLike[str] | str) -> tuple[list[tuple[str, str, tuple[int | str, ...]]], list[str]]:
    """Inputs ``(name, numpy dtype name, shape)`` and output names of a graph ONNX Runtime loads (``.ort`` too).

    Raises:
        ArtifactError: for a file ONNX Runtime cannot load as a graph.
    """
    try:
        session = onnxruntime.InferenceSession(
            os.fspath(path), sess_options=session_options(), providers=["CPUExecutionProvider"]
        )
    except (RuntimeError, _C.Fail, _C.InvalidArgument, _C.InvalidGraph, _C.InvalidProtobuf) as error:
        raise ArtifactError(
            f"ONNX Runtime cannot load {os.fspath(path)} ({' '.join(str(error).split())[:200]}); the file is "
            "damaged or truncated: copy it again from where the artifacts were generated, or regenerate them."
        ) from error
    inputs = []
    for arg in session.get_inputs():
        dtype = _ORT_TYPES.get(arg.type, arg.type)
        shape = tuple(dim if isinstance(dim, int | str) else "?" for dim in arg.shape or ())
        inputs.append((arg.name, dtype, shape))
    return inputs, [arg.name for arg in session.get_outputs()]


#: ONNX Runtime's type strings -> numpy dtype names (what `TensorSpec` records).
_ORT_TYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
}


def checkpoint_summary(path: os.PathLike[str] | str) -> tuple[list[tuple[str, tuple[int, ...], bool]], dict[str, Any]]:
    """Read a CheckpointState file: ``(name, shape, requires_grad)`` per parameter, and its properties."""
    state = CheckpointState.load_checkpoint(os.fspath(path))._state
    parameters = []
    for name in state.parameter_names():
        parameter = state.get_parameter(name)
        parameters.append((name, tuple(parameter.data.shape()), bool(parameter.requires_grad)))
    properties = {name: state.get_property(name) for name in state.property_names()}
    return parameters, properties


#: What ONNX Runtime raises for a checkpoint file it cannot parse.
CHECKPOINT_READ_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, _C.Fail, _C.InvalidArgument, _C.NoSuchFile)


def save_checkpoint(session: TrainingSession, path: os.PathLike[str] | str, *, include_optimizer_state: bool) -> None:
    """Write the session's CheckpointState (and optionally the optimizer's step and moments) to `path`."""
    _C.save_checkpoint(session._state._state, os.fspath(path), include_optimizer_state)


def set_properties(session: TrainingSession, properties: dict[str, int | float | str]) -> None:
    """Store int, float or str properties in the session's CheckpointState (saved with it)."""
    state = session._state._state
    for name, value in properties.items():
        state.add_property(name, value)


def export_for_inferencing(session: TrainingSession, path: os.PathLike[str] | str, outputs: Sequence[str]) -> None:
    """Write the eval graph with the current parameters as an inference model producing `outputs`."""
    session._module._model.export_model_for_inferencing(os.fspath(path), list(outputs))
