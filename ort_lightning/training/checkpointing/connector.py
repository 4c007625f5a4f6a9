"""`CheckpointConnector`: what an `ORTLightningModule` writes and reads, in one place.

The module's hooks and public methods hand their checkpoint work to it, as Lightning's
``Trainer`` hands its own to ``trainer/connectors/checkpoint_connector.py``:

- ORT checkpoint files (``save_ort_checkpoint``): the CheckpointState with the run's progress,
  seed and schedule as properties, written atomically with a digest;
- inference models (``export_inference_model``, ``to_onnx``): the eval graph with the current
  weights;
- Lightning's ``.ckpt`` (``on_save_checkpoint``, ``on_load_checkpoint``,
  ``load_from_checkpoint``): ORT's state as bytes, the run's progress and the artifacts'
  identity, checked on load;
- pickling (``__getstate__``, ``__setstate__``): the module without ORT's objects, rebuilt from
  the artifacts on the other side.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp()))
    >>> checkpoint = {}
    >>> module.on_save_checkpoint(checkpoint)
    >>> sorted(checkpoint)
    ['ort_lightning_artifacts', 'ort_lightning_progress', 'ort_state']
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ort_lightning.errors import ArtifactError, CheckpointError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.checkpointing.files import (
    ORT_STATE_KEY,
    PROGRESS_KEY,
    RunOrigin,
    export_inference,
    restored_state,
    state_bytes,
    state_digest,
    write_ort_checkpoint,
)
from ort_lightning.training.checkpointing.travel import (
    IDENTITY_KEY,
    check_identity,
    check_metrics,
    hyperparameters_of,
    identity_of,
    identity_of_state,
    metric_names,
    read_lightning_checkpoint,
    resolve_artifacts,
)
from ort_lightning.training.checkpointing.trust import check_code_hyperparameters
from ort_lightning.training.optim.schedules import schedule_properties
from ort_lightning.training.session.session_views import SessionViews, load_values, picklable, state_values, values_of

if TYPE_CHECKING:
    from ort_lightning.training.module import ORTLightningModule

__all__ = ["STATE_DIGEST_KEY", "CheckpointConnector", "find_artifacts"]

#: Where a ``.ckpt``'s progress record keeps the sha256 of its ORT state bytes.
STATE_DIGEST_KEY = "ort_state_sha256"


class CheckpointConnector:
    """The checkpoint work of one `ORTLightningModule`.

    Args:
        module: the module whose ORT state, progress and identity are written and read.
    """

    def __init__(self, module: ORTLightningModule) -> None:
        self.module = module

    @property
    def _hybrid(self) -> bool:
        """Whether a torch optimizer updates (its state is in Lightning's ``.ckpt``, ORT's is unused)."""
        return self.module._optimizer_factory is not None

    def save_ort_checkpoint(
        self, path: str | os.PathLike[str], *, include_optimizer_state: bool, properties: dict[str, Any] | None
    ) -> Path:
        """Write ORT's state with the run's progress, seed and schedule as properties; see the module's method."""
        module = self.module
        # NOTE: under a torch optimizer (hybrid training) ORT's optimizer state is never used;
        # the file holds the weights, and the torch optimizer's state lives in Lightning's .ckpt.
        include_optimizer_state = include_optimizer_state and not self._hybrid
        values: dict[str, int | float | str] = {
            "lr": float(module._session.get_lr()),
            "optimizer_state": int(include_optimizer_state),
            "seed": module._steps.seed_in_use(),
            **schedule_properties(module._schedule),
            **module._origin.progress_properties(module._trainer),
            **(properties or {}),
        }
        return write_ort_checkpoint(
            module._session, path, include_optimizer_state=include_optimizer_state, properties=values
        )

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None) -> Path:
        """Write the eval graph with the current weights, keeping `outputs` (None: the model's own)."""
        module = self.module
        names = list(outputs) if outputs is not None else list(module.artifacts.manifest.outputs)
        return export_inference(module._session, path, names)

    def to_onnx(self, file_path: Any, options: dict[str, Any]) -> Path:
        """Lightning's ``to_onnx``: the inference model at `file_path`; torch.onnx `options` are refused.

        Raises:
            ConfigurationError: for no file path (or a buffer), or ``torch.onnx.export`` options.
        """
        if not isinstance(file_path, (str, os.PathLike)) or options:
            given = f" and torch.onnx.export options {sorted(options)}" if options else ""
            raise ConfigurationError(
                f"to_onnx writes the eval graph ORT trains, with its current weights, to a file: it takes a path and "
                f"no export options, but got file_path={file_path!r}{given}; call "
                "module.export_inference_model(path, outputs=...) to choose the outputs."
            )
        return self.export_inference_model(file_path, None)

    def dump(self, checkpoint: dict[str, Any]) -> None:
        """Store ORT's state (weights, and the optimizer's unless hybrid), the progress and the identity."""
        module = self.module
        state = state_bytes(module._session, include_optimizer_state=not self._hybrid)
        checkpoint[ORT_STATE_KEY] = state
        checkpoint[PROGRESS_KEY] = {**module._origin.lightning_record(module._steps.seed_in_use()),
                                    STATE_DIGEST_KEY: state_digest(state)}
        checkpoint[IDENTITY_KEY] = {**identity_of(module.artifacts), "metrics": metric_names(module._metrics)}

    def restore(self, checkpoint: dict[str, Any]) -> bool:
        """Rebuild the module's ORT components from a ``.ckpt``'s state (True once done).

        Raises:
            CheckpointError: for a ``.ckpt`` without ORT state, of other artifacts, with a damaged state, digest,
                progress or identity record, or metrics it was trained with and that are not passed again.
        """
        module = self.module
        artifacts, source = module.artifacts, "The Lightning checkpoint"
        state = checkpoint.get(ORT_STATE_KEY)
        if state is None:
            raise CheckpointError(
                f"{source} holds no ORT state (no {ORT_STATE_KEY!r} entry among {sorted(map(str, checkpoint))[:12]}), "
                f"so the weights of {artifacts.directory} cannot be restored from it; it was not written by "
                "ORTLightningModule or it was edited: pass a .ckpt that ORTLightningModule saved."
            )
        progress = checkpoint.get(PROGRESS_KEY, {})
        origin = RunOrigin.of_lightning(progress)
        stored = checkpoint.get(IDENTITY_KEY)
        if stored is not None:
            check_identity(stored, identity_of(artifacts), source=source, folder=artifacts.directory)
            check_metrics(stored.get("metrics", {}), bool(module._metrics), source=source)
        with restored_state(state, digest=progress.get(STATE_DIGEST_KEY)) as path, _unreadable_state(source):
            if stored is None:  # NOTE: a .ckpt written before the identity was stored: check its parameters
                check_identity(
                    identity_of_state(path, artifacts), identity_of(artifacts), source=source,
                    folder=artifacts.directory,
                )
            module._attach(module._ort.rebuilt(module, checkpoint=path))
        module._set_origin(origin)
        return True

    def getstate(self, state: dict[str, Any]) -> dict[str, Any]:
        """The module's pickled ``__dict__``: without ORT's objects, with the device to rebuild them on."""
        state = picklable(state, "_ort", self.module._ort)
        state["_schedule"] = None  # it holds the optimizer, which holds ORT's objects
        return state

    def rebuild(self, device: str) -> None:
        """After unpickling: rebuild ORT's objects on `device` from the artifacts, then restore the pickled values."""
        module = self.module
        values = values_of(module)
        # NOTE: a weightless folder has no weights to build from: its nominal checkpoint takes the pickled ones.
        named = state_values(module, module.artifacts) if module.artifacts.weightless else None
        module._attach(SessionViews(module, module.artifacts, device=device, custom_op_library=module.custom_op_library,
                                    values=named, **module._thread_options(None)))
        load_values(module, values)


@contextlib.contextmanager
def _unreadable_state(source: str) -> Iterator[None]:
    """Turn ONNX Runtime's refusal of a ``.ckpt``'s ORT state (written before digests) into a `CheckpointError`."""
    unreadable: tuple[type[BaseException], ...] = (ArtifactError, *_ort.CHECKPOINT_READ_ERRORS)
    try:
        yield
    except unreadable as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(
            f"{source}'s ORT state cannot be read ({' '.join(str(error).split())[-200:]}); the .ckpt is damaged or "
            "truncated: resume from another checkpoint (an earlier .ckpt, or an ORTCheckpoint .ortckpt file)."
        ) from error


def find_artifacts(checkpoint_path: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for ``load_from_checkpoint``, with ``artifacts=`` found relative to a moved ``.ckpt``.

    The stored artifacts path is used when it exists; else the folder is looked for beside the
    ``.ckpt`` and in its parent folders; an ``artifacts=`` the caller gave wins.

    Stored hyper-parameters that name code to load or run are refused first, unless `kwargs` passes
    them again (`ort_lightning.training.checkpointing.trust`); with ``hparams_file=`` the caller's file replaces them.

    Raises:
        CheckpointError: for a file that is not a ``.ckpt`` torch wrote or holds no dict, artifacts found
            nowhere (pass ``artifacts=``), or a stored hyper-parameter that names code (a custom operator
            library, a factory) and is not passed again.
    """
    hparams = hyperparameters_of(read_lightning_checkpoint(checkpoint_path))
    if kwargs.get("hparams_file") is None:
        check_code_hyperparameters(hparams, kwargs, source=f"Checkpoint {checkpoint_path}")
    if "artifacts" in kwargs:
        return kwargs
    found = resolve_artifacts(checkpoint_path, hparams)
    return kwargs if found is None else {**kwargs, "artifacts": found}
