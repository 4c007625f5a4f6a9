"""`CheckpointHooks`: the checkpoint hooks of `ORTLightningModule`, each handing its work to the connector.

`ORTLightningModule` takes this group of hooks and methods as Lightning's ``LightningModule`` takes
its hook groups from ``core/hooks.py``: its ORT checkpoint files (``save_ort_checkpoint``), inference
models (``export_inference_model``, ``to_onnx``), transformers and peft folders (``save_pretrained``),
Lightning's ``.ckpt`` (``on_save_checkpoint``, ``on_load_checkpoint``, ``load_from_checkpoint``),
another start (``load_values``), new values in place (``set_values``) and where its run starts
(``start_progress``). The hooks hold no state: the
module's `CheckpointConnector` (its ``checkpointing``, a collaborator with declared inputs) owns the
run's origin and the fit's schedule.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> isinstance(module, CheckpointHooks), module.start_progress
    (True, {'global_step': 0, 'epoch': 0})
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from ort_lightning.training.checkpointing.connector import CheckpointConnector, find_artifacts
from ort_lightning.training.checkpointing.pretrained import save_pretrained

__all__ = ["CheckpointHooks"]


class CheckpointHooks(pl.LightningModule):
    """What an `ORTLightningModule` writes and reads: each hook hands its work to `checkpointing`.

    Attributes:
        checkpointing: the collaborator that does the work and owns the run's origin (`CheckpointConnector`),
            built by the module.
    """

    checkpointing: CheckpointConnector

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
            properties: int, float or str values stored in the file. Always added: ``lr`` (under a
                torch optimizer, its rate once a fit built it), ``ort_lightning_version``,
                ``optimizer_state`` (1 or 0) and ``seed`` (ORT's random stream); the linear schedule's
                ``schedule_lr``, ``schedule_warmup_steps`` and ``schedule_total_steps``; ``global_step``,
                ``epoch`` and ``next_epoch`` (the epoch a resume starts in), counted across resumes (outside
                a fit: where the run started, when not at the beginning). The file holds these and
                nothing else: no property of the checkpoint this run started from is copied into it.

        Returns:
            The path written.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        return self.checkpointing.save_ort_checkpoint(
            path, include_optimizer_state=include_optimizer_state, properties=properties, trainer=self._trainer)

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
        return self.checkpointing.export_inference_model(path, outputs)

    def save_pretrained(
        self, folder: str | os.PathLike[str], *, model: Any = None, merge: bool = False
    ) -> Path:
        """Write the trained model as the folder transformers or peft loads (`ort_lightning.save_pretrained`).

        A peft model writes its adapter folder (``PeftModel.from_pretrained(base, folder)``), a
        transformers model ``model.safetensors`` + ``config.json`` (``AutoModelForCausalLM.from_pretrained``).

        Args:
            folder: where the model writes itself; created if missing, its files replaced.
            model: the torch model the artifacts were exported from, for artifacts that record no
                transformers model; its parameters take the trained values.
            merge: merge the peft adapters into the base weights and write the merged model.

        Returns:
            The folder.

        Raises:
            ArtifactError: for artifacts that record no transformers model and no `model`.
        """
        return save_pretrained(self, folder, model=model, merge=merge)

    @override
    def to_onnx(self, file_path: Any = None, input_sample: Any = None, **kwargs: Any) -> None:
        """Write the inference model, as `export_inference_model` does (`input_sample` is not needed).

        Lightning's ``to_onnx`` traces ``forward`` with ``torch.onnx``; here the graph already exists.

        Raises:
            ConfigurationError: for no file path (or a buffer), or ``torch.onnx.export`` options.
        """
        self.checkpointing.to_onnx(file_path, kwargs)

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run.

        Nonzero when the run started from an ORT checkpoint: the first epoch of this run is epoch
        ``start_progress["epoch"]`` of the whole training, so that numbers never repeat.
        """
        return self.checkpointing.progress

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the full ORT state (weights, optimizer step and moments) as uint8 bytes, the progress and identity.

        Under hybrid training the weights only: the torch optimizer's state is Lightning's own entry.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self.checkpointing.dump(checkpoint, self._trainer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs).

        Raises:
            CheckpointError: for a ``.ckpt`` of other artifacts, or metrics it was trained with and that
                are not passed again.
        """
        self.checkpointing.restore(checkpoint)

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
    def set_values(self, values: Mapping[str, Any]) -> None:
        """Copy `values` into the running ORT session's memory: nothing is rebuilt, nothing else changes.

        Unlike `load_values` (another start: a fresh or kept optimizer state), the optimizer state,
        the training progress and the thread setting stay as they are; the parameters stay the same
        objects over the same memory. Through the one operation that changes a running session
        (`ort_lightning.training.session.live.LiveSession.replace` with ``values=`` alone).

        Args:
            values: name -> tensor or numpy array, for every state tensor of the training graph
                (``ort_lightning.fleet.get_values`` of a module of these artifacts).

        Raises:
            ConfigurationError: for missing, unexpected or misshapen values.

        Example::

            >>> import tempfile, torch
            >>> from ort_lightning import ORTLightningModule, export_artifacts
            >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
            >>> module = ORTLightningModule(artifacts)
            >>> session = module.ort_session
            >>> module.set_values({"weight": torch.ones(3, 4), "bias": torch.zeros(3)})
            >>> float(module.weight.detach().sum()), module.ort_session is session
            (12.0, True)
        """
        self.checkpointing.set_values(values)

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
        self.checkpointing.load_values(values, optimizer_state=kept, evaluation=evaluation)
