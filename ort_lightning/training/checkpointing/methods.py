"""`CheckpointHooks`: the checkpoint hooks and methods of `ORTLightningModule`.

A hook group, as Lightning's ``core/hooks.py``: each method hands its work to the module's
`CheckpointConnector`, which owns the run's origin; the hooks hold no state.
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
    """What an `ORTLightningModule` writes and reads; `checkpointing` (the connector) does the work."""

    checkpointing: CheckpointConnector

    def save_ort_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_optimizer_state: bool = True,
        properties: dict[str, int | float | str] | None = None,
    ) -> Path:
        """Write the ORT CheckpointState to `path` atomically, with a ``.sha256`` sidecar digest.

        ORT's ``CheckpointState.load_checkpoint`` reads the file, and ``ORTLightningModule(artifacts,
        checkpoint=path)`` resumes from it.

        Args:
            path: the checkpoint file to create or replace.
            include_optimizer_state: also store the optimizer's step and moments (an exact resume needs
                them); under a torch optimizer the file holds the weights only.
            properties: int, float or str values stored beside the ones always added (``lr``,
                ``ort_lightning_version``, ``seed``, the schedule, ``global_step``, ``epoch``, ``next_epoch``).

        Returns:
            The path written.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        return self.checkpointing.save_ort_checkpoint(
            path, include_optimizer_state=include_optimizer_state, properties=properties, trainer=self._trainer)

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None = None) -> Path:
        """Write the eval graph with the current weights as a plain ONNX model for ``InferenceSession``.

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

        Args:
            folder: where the model writes itself; created if missing, its files replaced.
            model: the torch model the artifacts came from, for artifacts that record no transformers model.
            merge: merge the peft adapters into the base weights and write the merged model.

        Returns:
            The folder.

        Raises:
            ArtifactError: for artifacts that record no transformers model and no `model`.
        """
        return save_pretrained(self, folder, model=model, merge=merge)

    @override
    def to_onnx(self, file_path: Any = None, input_sample: Any = None, **kwargs: Any) -> None:
        """Lightning's ``to_onnx``: the graph already exists, so this writes the inference model.

        Raises:
            ConfigurationError: for no file path (or a buffer), or ``torch.onnx.export`` options.
        """
        self.checkpointing.to_onnx(file_path, kwargs)

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run."""
        return self.checkpointing.progress

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the ORT state (weights, and the optimizer's step and moments unless hybrid), progress and identity.

        Raises:
            NonFiniteLossError: inside a fit, when the last update left NaN/inf in the parameters.
        """
        self.checkpointing.dump(checkpoint, self._trainer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs).

        Raises:
            CheckpointError: for a ``.ckpt`` of other artifacts, or metrics it was trained with and not passed again.
        """
        self.checkpointing.restore(checkpoint)

    @classmethod
    @override
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, finding a moved artifacts folder beside the ``.ckpt`` or above it.

        Nothing the ``.ckpt`` names is loaded as code: a stored ``custom_op_library`` must be passed again.

        Raises:
            CheckpointError: for artifacts found nowhere (pass ``artifacts=``) or of another model or
                optimizer, or metrics or code the ``.ckpt`` names and that are not passed again.
        """
        return super().load_from_checkpoint(checkpoint_path, *args, **find_artifacts(checkpoint_path, kwargs))

    # ----------------------------------------------------------------------------- another start, same module
    def set_values(self, values: Mapping[str, Any]) -> None:
        """Copy `values` into the running session's memory; the optimizer state and progress stay as they are.

        Args:
            values: name -> tensor or numpy array, for every state tensor of the training graph.

        Raises:
            ConfigurationError: for missing, unexpected or misshapen values.
        """
        self.checkpointing.set_values(values)

    def load_values(
        self, values: Any, *, optimizer_state: str | os.PathLike[str] | None = None, evaluation: bool = True,
    ) -> None:
        """Start again from `values`, with a fresh optimizer state or the one `optimizer_state` holds.

        ONNX Runtime sets an optimizer state only when it builds its objects, so an AdamW start rebuilds them.

        Args:
            values: name -> tensor for every state tensor.
            optimizer_state: an ORT checkpoint of these artifacts whose optimizer state (and counts) to
                continue; None starts fresh.
            evaluation: False builds the training objects alone (a fleet device's round); the eval graph
                comes back on first use.

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
