"""`CheckpointMethods`: the checkpoint part of `ORTLightningModule`, what it writes and reads.

`ORTLightningModule` derives from it: its ORT checkpoint files (``save_ort_checkpoint``), inference
models (``export_inference_model``, ``to_onnx``), Lightning's ``.ckpt`` (``on_save_checkpoint``,
``on_load_checkpoint``, ``load_from_checkpoint``) and where its run starts (``start_progress``).
Each method hands the work to the module's `CheckpointConnector`, with the run's origin and
schedule as arguments.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> isinstance(module, CheckpointMethods), module.start_progress
    (True, {'global_step': 0, 'epoch': 0})
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from typing_extensions import override

from ort_lightning.training.checkpointing.connector import CheckpointConnector, find_artifacts
from ort_lightning.training.checkpointing.files import RunOrigin, read_checkpoint_state

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts
    from ort_lightning.training.session.live import LiveSession
    from ort_lightning.training.session.step import StepPath

__all__ = ["CheckpointMethods"]


class CheckpointMethods(pl.LightningModule):
    """What an `ORTLightningModule` writes and reads; the module sets the attributes below.

    Attributes:
        _checkpoints: does the work.
        _origin: where the run starts in the whole training (the checkpoint it started from).
        _schedule: the scheduler of the current fit (its settings go into ORT checkpoint files).
        _steps: the module's step path (it continues the origin's steps and seed).
        _state_restored: set when a ``.ckpt`` was restored, so that ``configure_optimizers`` keeps its state.
        _optimizers_configured: set by ``configure_optimizers``; a later fit starts a fresh optimizer state.
        _live: the running session, changed only through its ``replace``.
        _optimizer_factory: a torch optimizer's factory (its update holds no state in ORT), or None.
    """

    _checkpoints: CheckpointConnector
    _origin: RunOrigin
    _schedule: Any
    _steps: StepPath
    _state_restored: bool
    _optimizers_configured: bool
    _live: LiveSession
    _optimizer_factory: Any
    artifacts: TrainingArtifacts

    def _set_origin(self, origin: RunOrigin) -> None:
        """Continue the steps, epochs and seed of the run that wrote the checkpoint this run starts from."""
        self._origin = origin
        self._steps.continue_run(origin.step, origin.seed)

    def save_ort_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_optimizer_state: bool = True,
        properties: dict[str, int | float | str] | None = None,
    ) -> Path:
        """Write the ORT CheckpointState to `path` atomically, with a ``.sha256`` sidecar digest.

        The file is what ``onnxruntime.training.api.CheckpointState.load_checkpoint`` reads and
        what ``ORTLightningModule(artifacts, checkpoint=path)`` resumes from.

        Args:
            path: the checkpoint file to create or replace.
            include_optimizer_state: also store the optimizer's step count and moments, which an
                exact resume needs. Under hybrid training (``optimizer=`` a torch optimizer) the file
                holds the weights only: the torch optimizer's state is in Lightning's ``.ckpt``.
            properties: int, float or str values stored in the file. Always added: ``lr``,
                ``ort_lightning_version``, ``optimizer_state`` (1 or 0) and ``seed`` (ORT's random
                stream); the linear schedule's ``schedule_lr``, ``schedule_warmup_steps`` and
                ``schedule_total_steps``; inside a fit, ``global_step``, ``epoch`` and ``next_epoch``
                (the epoch a resume starts in), counted across resumes.

        Returns:
            The path written.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self._check_parameters()
        return self._checkpoints.save_ort_checkpoint(
            path, include_optimizer_state=include_optimizer_state, properties=properties, origin=self._origin,
            schedule=self._schedule, trainer=self._trainer)

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None = None) -> Path:
        """Write the eval graph with the current weights as a plain ONNX inference model.

        The model takes the model inputs only (no labels) and runs in
        ``onnxruntime.InferenceSession``.

        Args:
            path: the ``.onnx`` file to create or replace (atomically).
            outputs: eval graph outputs to keep; None keeps the model's own outputs.

        Returns:
            The path written.

        Raises:
            ConfigurationError: for an output name the eval graph does not have.
        """
        return self._checkpoints.export_inference_model(path, outputs)

    @override
    def to_onnx(self, file_path: Any = None, input_sample: Any = None, **kwargs: Any) -> None:
        """Write the inference model, as `export_inference_model` does (`input_sample` is not needed).

        Lightning's ``to_onnx`` traces ``forward`` with ``torch.onnx``; here the graph already exists.

        Raises:
            ConfigurationError: for no file path (or a buffer), or ``torch.onnx.export`` options.
        """
        self._checkpoints.to_onnx(file_path, kwargs)

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run.

        Nonzero when the run started from an ORT checkpoint: the first epoch of this run is epoch
        ``start_progress["epoch"]`` of the whole training, so that numbers never repeat.
        """
        return {"global_step": self._origin.step, "epoch": self._origin.epoch}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the full ORT state (weights, optimizer step and moments) as uint8 bytes, the progress and identity.

        Under hybrid training the weights only: the torch optimizer's state is Lightning's own entry.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self._check_parameters()
        self._checkpoints.dump(checkpoint, self._origin)

    def _check_parameters(self) -> None:
        # NOTE: between two saves the next step's NaN loss shows an overflowed update; the steps pay nothing.
        if self._trainer is not None and self._trainer.training:
            self._steps.check_parameters(self._trainer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs).

        Raises:
            CheckpointError: for a ``.ckpt`` of other artifacts, or metrics it was trained with and that
                are not passed again.
        """
        self._set_origin(self._checkpoints.restore(checkpoint))
        self._state_restored = True

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, finding a moved artifacts folder relative to the ``.ckpt``.

        The stored artifacts path is used when it exists; else the folder is looked for beside the
        ``.ckpt`` and in its parent folders; ``artifacts=`` overrides both. The ``.ckpt``'s artifacts
        (graph digests, parameters, optimizer kind) must be the ones it is loaded onto.

        Nothing the ``.ckpt`` names is loaded or run as code: a stored ``custom_op_library`` (or a
        factory, or a path to a shared library) is refused unless passed again,
        ``load_from_checkpoint(path, custom_op_library=...)``.

        Raises:
            CheckpointError: for artifacts found nowhere (pass ``artifacts=``), artifacts of another model
                or optimizer, metrics the ``.ckpt`` was trained with and that are not passed again, or a stored
                hyper-parameter naming code to load that is not passed again.
        """
        return super().load_from_checkpoint(checkpoint_path, *args, **find_artifacts(checkpoint_path, kwargs))

    # ----------------------------------------------------------------------------- another start, same module
    def load_values(
        self, values: Any, *, optimizer_state: str | os.PathLike[str] | None = None, evaluation: bool = True,
    ) -> None:
        """Start again from `values`: with a fresh optimizer state, or with the one `optimizer_state` kept.

        What a new module of the same artifacts built with ``values=values`` (and
        ``checkpoint=optimizer_state``) starts from, in this module, through the one operation that
        changes a running session (`ort_lightning.training.session.live.LiveSession.replace`).
        ONNX Runtime sets an optimizer state (step and moments) only when it builds its objects, so
        a fresh AdamW state or a kept one rebuilds them; where ORT holds no optimizer state (an SGD
        graph, a torch optimizer's update) a fresh start only copies the values into ORT's memory.
        Gradients start at zero either way; the next fit keeps the optimizer state.

        Args:
            values: name -> tensor for every state tensor (``ort_lightning.fleet.get_values`` of a module of
                these artifacts).
            optimizer_state: an ORT checkpoint file of these artifacts whose optimizer state to continue
                (``save_ort_checkpoint(..., include_optimizer_state=True)``): its steps and epochs count on,
                as with ``checkpoint=``; None starts a fresh optimizer state, its steps counted from 0.
            evaluation: False, where ORT's objects are rebuilt, builds them for training alone (no eval
                graph: one session fewer to build and hold, as a fleet device's round needs); the first
                forward, validation, test, prediction or inference export builds the eval graph again.

        Raises:
            ConfigurationError: for `values` with missing, unexpected or misshapen tensors.
            CheckpointError: for an `optimizer_state` file that is damaged or of other artifacts.

        Example::

            >>> import tempfile, torch
            >>> from ort_lightning import ORTLightningModule, export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
            >>> module = ORTLightningModule(artifacts)
            >>> module.load_values({"weight": torch.ones(3, 4), "bias": torch.zeros(3)})
            >>> float(module.weight.detach().sum()), module.start_progress["global_step"]
            (12.0, 0)
        """
        kept = None if optimizer_state is None else Path(optimizer_state)
        settings = dataclasses.replace(self._live.settings, evaluation=evaluation)
        if kept is not None:
            properties, held = read_checkpoint_state(kept, self.artifacts, weights_given=True)
            origin = RunOrigin.of_file(properties)
            self._live.replace(checkpoint=held, values=values, settings=settings)
        elif self._optimizer_factory is not None or self._live.session.optimizer_kind != "adamw":
            # NOTE: no optimizer state in ORT (SGD, a torch optimizer's update): the values are all there is to load.
            origin = RunOrigin(seed=self._steps.seed)
            self._live.replace(values=values)
            self._steps.reset()
        else:
            origin = RunOrigin(seed=self._steps.seed)
            self._live.replace(values=values, include_optimizer_state=False, settings=settings)
        self._set_origin(origin)
        self._optimizers_configured, self._state_restored = False, kept is not None
