"""Checkpoint methods of `ORTLightningModule`: ORT checkpoint files, Lightning ``.ckpt``, inference export.

ORT's CheckpointState (weights, optimizer step and moments) is the whole training state; a
Lightning checkpoint carries it as the bytes of an ORT checkpoint file in a uint8 tensor, so
that the ``.ckpt`` still loads with ``torch.load(weights_only=True)``. Resuming rebuilds the
ORT components from those bytes in ``on_load_checkpoint``, which Lightning runs before
``configure_optimizers``, so the optimizer is created over the restored state.

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> folder = Path(tempfile.mkdtemp())
    >>> module = ORTLightningModule(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder / "a"))
    >>> path = module.save_ort_checkpoint(folder / "start.ortckpt")
    >>> resumed = ORTLightningModule(folder / "a", checkpoint=path)
    >>> bool(torch.equal(resumed.weight, module.weight))
    True
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ort_lightning import _ort
from ort_lightning._atomic import atomic_write, verify_digest
from ort_lightning._schedules import Progress, schedule_properties
from ort_lightning._step import StepPath
from ort_lightning.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = ["CheckpointingMixin", "ORT_STATE_KEY"]

#: Key of the ORT checkpoint bytes in a Lightning checkpoint dict.
ORT_STATE_KEY = "ort_state"
#: Key of the step and epoch counted before this run (a run started with ``checkpoint=``).
_PROGRESS_KEY = "ort_lightning_progress"

ParameterSummary = list[tuple[str, tuple[int, ...], bool]]


def _version() -> str:
    from ort_lightning import __version__

    return __version__


def _read_checkpoint(path: Path) -> tuple[ParameterSummary, dict[str, Any]]:
    verify_digest(path)
    try:
        return _ort.checkpoint_summary(path)
    except _ort.CHECKPOINT_READ_ERRORS as error:
        raise CheckpointError(
            f"ONNX Runtime cannot read checkpoint {path} ({' '.join(str(error).split())[:160]}); it is not an "
            "ORT checkpoint or it is damaged: resume from another checkpoint file."
        ) from error


def _mismatch(found: ParameterSummary, expected: ParameterSummary) -> str:
    have = {name: (shape, grad) for name, shape, grad in found}
    want = {name: (shape, grad) for name, shape, grad in expected}
    problems = []
    if missing := sorted(set(want) - set(have)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(have) - set(want)):
        problems.append(f"unexpected {unexpected}")
    differ = [f"{n}: {have[n][0]} (trainable={have[n][1]}) vs {want[n][0]} (trainable={want[n][1]})"
              for n in sorted(set(have) & set(want)) if have[n] != want[n]]
    if differ:
        problems.append("different " + "; ".join(differ))
    return ", ".join(problems)


class CheckpointingMixin:
    """Checkpoint methods mixed into `ORTLightningModule` (ahead of ``LightningModule``)."""

    artifacts: TrainingArtifacts
    _session: _ort.TrainingSession
    _start_progress: dict[str, int]
    _state_restored: bool
    _optimizer_factory: Any
    _resumed: dict[str, Any]
    _source_properties: dict[str, Any]
    _schedule_start: Progress
    _schedule: Any
    _steps: StepPath

    if TYPE_CHECKING:
        trainer: Any
        _trainer: Any

        def _assemble(
            self, device: str, checkpoint: str | os.PathLike[str] | None = None, *, spinning: bool = True
        ) -> _ort.TrainingSession: ...

    # ----------------------------------------------------------------------------- assembly source
    @contextlib.contextmanager
    def _checkpoint_source(self, checkpoint: str | os.PathLike[str] | None) -> Iterator[Path]:
        """Yield the checkpoint file to assemble from.

        An explicit `checkpoint` is verified (digest, readability, parameters matching the
        artifacts); otherwise a running session is snapshotted, so that rebuilding on another
        device keeps the training progress; otherwise the artifacts' initial checkpoint is used.
        """
        if checkpoint is not None:
            path = Path(checkpoint)
            self._check_matches_artifacts(path)
            yield path
        elif getattr(self, "_session", None) is not None:
            with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
                snapshot = Path(folder) / "state"
                _ort.save_checkpoint(self._session, snapshot, include_optimizer_state=True)
                yield snapshot
        else:
            yield self.artifacts.checkpoint

    def _restart_optimizer(self) -> None:
        """Rebuild the ORT components from the current weights with a fresh optimizer state.

        What torch Lightning gets on every ``fit``: ``configure_optimizers`` makes a new optimizer
        (step 0, no moments), so a second ``fit`` warms up and decays again instead of staying at
        the end of the first one's schedule (ORT computes the lr from the optimizer's own step).
        """
        with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
            snapshot = Path(folder) / "state"
            _ort.save_checkpoint(self._session, snapshot, include_optimizer_state=False)
            self._session = self._assemble(self._session.device, snapshot, spinning=self._session.spinning)
        self._start_progress = {"global_step": 0, "epoch": 0}
        self._steps.step_offset = 0

    def _check_matches_artifacts(self, path: Path) -> None:
        found, properties = _read_checkpoint(path)
        expected, _ = _ort.checkpoint_summary(self.artifacts.checkpoint)
        problems = _mismatch(found, expected)
        if problems:
            raise CheckpointError(
                f"Checkpoint {path} does not match the artifacts in {self.artifacts.directory}: its parameters are "
                f"{problems}; pass a checkpoint written while training these artifacts, or the artifacts it came from."
            )
        self._source_properties = properties

    def _resume_from(self, properties: dict[str, Any]) -> None:
        """Continue the progress, schedule and seed of the run that wrote an ORT checkpoint (``checkpoint=``)."""
        # NOTE: "next_epoch" says whether the saving epoch had finished; older files have "epoch" only.
        step = int(properties.get("global_step", 0))
        epoch = int(properties.get("next_epoch", properties.get("epoch", 0)))
        self._start_progress = {"global_step": step, "epoch": epoch}
        self._resumed = properties
        with_optimizer = bool(int(properties.get("optimizer_state", 1)))
        self._schedule_start = Progress(step=step, epoch=epoch) if with_optimizer else Progress()
        self._steps.step_offset = step
        if "seed" in properties:
            self._steps.seed = int(properties["seed"])

    @property
    def start_progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run.

        Nonzero when the run started from an ORT checkpoint: the first epoch of this run is epoch
        ``start_progress["epoch"]`` of the whole training, so that numbers never repeat.
        """
        return dict(getattr(self, "_start_progress", None) or {"global_step": 0, "epoch": 0})

    def _progress_properties(self) -> dict[str, int]:
        """Where training stands, counted across resumes; empty outside a Trainer."""
        trainer = self._trainer
        if trainer is None:
            return {}
        start = self.start_progress
        epochs = trainer.fit_loop.epoch_progress.current
        return {"global_step": start["global_step"] + trainer.global_step, "epoch": start["epoch"] + epochs.completed,
                "next_epoch": start["epoch"] + epochs.processed}

    # ----------------------------------------------------------------------------- ORT checkpoint files
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
        """
        # NOTE: under a torch optimizer (hybrid training) ORT's optimizer state is never used;
        # the file holds the weights, and the torch optimizer's state lives in Lightning's .ckpt.
        include_optimizer_state = include_optimizer_state and self._optimizer_factory is None
        values: dict[str, int | float | str] = {"lr": float(self._session.get_lr())}
        values["ort_lightning_version"] = _version()
        values["optimizer_state"] = int(include_optimizer_state)
        values["seed"] = self._steps.seed_in_use()
        values.update(schedule_properties(self._schedule))
        values.update(self._progress_properties())
        values.update(properties or {})
        _ort.set_properties(self._session, values)
        session = self._session
        atomic_write(
            path, lambda temp: _ort.save_checkpoint(session, temp, include_optimizer_state=include_optimizer_state)
        )
        return Path(path)

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
        names = list(outputs) if outputs is not None else list(self.artifacts.manifest.outputs)
        available = self._session.output_names(training=False)
        unknown = [name for name in names if name not in available]
        if unknown or not names:
            raise ConfigurationError(
                f"Expected `outputs` to name outputs of the eval graph {available}, but got {names}; "
                "pass some of those names, or None for the model's own outputs."
            )
        session = self._session
        atomic_write(path, lambda temp: _ort.export_for_inferencing(session, temp, names), digest=False)
        return Path(path)

    # ----------------------------------------------------------------------------- Lightning checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Store the full ORT state (weights, optimizer step and moments) as uint8 bytes."""
        with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
            path = Path(folder) / "state"
            _ort.save_checkpoint(self._session, path, include_optimizer_state=self._optimizer_factory is None)
            data = bytearray(path.read_bytes())
        checkpoint[ORT_STATE_KEY] = torch.frombuffer(data, dtype=torch.uint8)
        checkpoint[_PROGRESS_KEY] = {"version": _version(), "seed": self._steps.seed_in_use(), **self.start_progress}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Rebuild the ORT components from the stored state (before ``configure_optimizers`` runs)."""
        state = checkpoint.get(ORT_STATE_KEY)
        if state is None:
            return
        if not isinstance(state, torch.Tensor) or state.dtype is not torch.uint8:
            raise CheckpointError(
                f"Expected checkpoint[{ORT_STATE_KEY!r}] to be a uint8 tensor of ORT checkpoint bytes, but got "
                f"{type(state).__name__}; load a checkpoint written by ORTLightningModule."
            )
        with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
            path = Path(folder) / "state"
            path.write_bytes(state.cpu().numpy().tobytes())
            self._session = self._assemble(self._session.device, path, spinning=self._session.spinning)
        self._state_restored = True
        progress = checkpoint.get(_PROGRESS_KEY, {})
        self._start_progress = {key: int(progress.get(key, 0)) for key in ("global_step", "epoch")}
        self._steps.step_offset = self._start_progress["global_step"]
        if "seed" in progress:
            self._steps.seed = int(progress["seed"])
