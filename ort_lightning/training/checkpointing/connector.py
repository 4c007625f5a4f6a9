"""`CheckpointConnector`: what an `ORTLightningModule` writes and reads, and where its run starts.

The module's hooks hand their checkpoint work to it, as Lightning's ``Trainer`` does to its
``checkpoint_connector``: ORT checkpoint files, inference models, Lightning's ``.ckpt`` and the
start of each fit. It owns the run's `RunState` and the fit's schedule, so no other object keeps them.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> checkpoint = {}
    >>> ORTLightningModule(artifacts).on_save_checkpoint(checkpoint)
    >>> sorted(checkpoint)
    ['ort_lightning_artifacts', 'ort_lightning_progress', 'ort_state']
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ort_lightning.errors import ArtifactError, CheckpointError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.training.checkpointing.checkpoint_files import (
    ORT_STATE_KEY,
    PROGRESS_KEY,
    RunOrigin,
    export_inference,
    read_checkpoint_state,
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

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts
    from ort_lightning.training.optim.schedules import Progress
    from ort_lightning.training.session.live import LiveSession
    from ort_lightning.training.session.step import StepPath

__all__ = ["STATE_DIGEST_KEY", "CheckpointConnector", "RunState", "find_artifacts"]

#: Where a ``.ckpt``'s progress record keeps the sha256 of its ORT state bytes.
STATE_DIGEST_KEY = "ort_state_sha256"


@dataclass
class RunState:
    """Where a module's run stands between its fits: its `origin`, and whether the next fit keeps a `restored` state."""

    origin: RunOrigin = field(default_factory=RunOrigin)
    restored: bool = False
    configured: bool = False


class CheckpointConnector:
    """The checkpoint work of one `ORTLightningModule`, given what it works on.

    Args:
        live: the module's running ORT session.
        steps: the module's step path (the seed of ORT's random stream).
        artifacts: what is trained.
        hybrid: whether a torch optimizer updates (its state is in Lightning's ``.ckpt``).
        metrics: the module's metrics by stage (a ``.ckpt`` records their names).
        run: where the run stands; None starts at the beginning.
        planned: the schedule's properties before a fit builds the schedule.
    """

    def __init__(
        self, live: LiveSession, steps: StepPath, artifacts: TrainingArtifacts, *, hybrid: bool,
        metrics: Mapping[str, Any], run: RunState | None = None, planned: Mapping[str, int | float | str] | None = None,
    ) -> None:
        self.live, self.steps, self.artifacts = live, steps, artifacts
        self.hybrid, self.metrics = hybrid, metrics
        self.planned = dict(planned or {})
        self.run = RunState() if run is None else run
        self.schedule: Any = None
        self.start_from(self.run.origin)

    def start_from(self, origin: RunOrigin) -> None:
        """Continue the steps, epochs and seed of the run that wrote the checkpoint this run starts from."""
        self.run.origin = origin
        self.steps.continue_run(origin.step, origin.seed)

    def count_from_zero(self) -> None:
        """Count steps and epochs from 0 from here, for an owner that counts its own (a fleet server's rounds)."""
        origin = self.run.origin
        self.start_from(RunOrigin(seed=self.steps.seed, properties=origin.properties))

    @property
    def progress(self) -> dict[str, int]:
        """Optimizer steps (``"global_step"``) and epochs (``"epoch"``) done before this run."""
        return {"global_step": self.run.origin.step, "epoch": self.run.origin.epoch}

    def begin_fit(self) -> Progress:
        """Start a fit's optimizer state (fresh, unless just restored); return the schedule's start."""
        run = self.run
        if run.configured and not run.restored:
            self.live.replace(include_optimizer_state=False)
            self.start_from(RunOrigin(seed=self.steps.seed))
        run.configured, run.restored = True, False
        return run.origin.schedule

    def check_parameters(self, trainer: Any) -> None:
        """Inside a fit, stop it when the last update left NaN/inf in the parameters (`NonFiniteLossError`)."""
        # NOTE: between two saves the next step's NaN loss shows an overflowed update; the steps pay nothing.
        if trainer is not None and trainer.training:
            self.steps.check_parameters(trainer)

    def set_values(self, values: Mapping[str, Any]) -> None:
        """Copy `values` into the running session's memory (see the module's method)."""
        self.live.replace(values=values)

    def load_values(self, values: Any, *, optimizer_state: Path | None, evaluation: bool) -> None:
        """Start again from `values` (see the module's method)."""
        live = self.live
        settings = dataclasses.replace(live.settings, evaluation=evaluation)
        if optimizer_state is not None:
            properties, held = read_checkpoint_state(optimizer_state, self.artifacts, weights_given=True)
            origin = RunOrigin.of_file(properties)
            live.replace(checkpoint=held, values=values, settings=settings)
        elif self.hybrid or live.session.optimizer_kind != "adamw":
            # NOTE: no optimizer state in ORT (SGD, a torch optimizer's update): the values are all there is to load.
            origin = RunOrigin(seed=self.steps.seed)
            live.replace(values=values)
            self.steps.reset()
        else:
            origin = RunOrigin(seed=self.steps.seed)
            live.replace(values=values, include_optimizer_state=False, settings=settings)
        self.start_from(origin)
        self.run.configured, self.run.restored = False, optimizer_state is not None

    def save_ort_checkpoint(
        self, path: str | os.PathLike[str], *, include_optimizer_state: bool, properties: dict[str, Any] | None,
        trainer: Any,
    ) -> Path:
        """Write ORT's state with the run's progress, seed and schedule as properties (see the module's method)."""
        self.check_parameters(trainer)
        # NOTE: under a torch optimizer (hybrid training) ORT's optimizer state is never used;
        # the file holds the weights, and the torch optimizer's state lives in Lightning's .ckpt.
        include_optimizer_state = include_optimizer_state and not self.hybrid
        session = self.live.session
        values: dict[str, int | float | str] = {
            **self._learning_rate(trainer),
            "optimizer_state": int(include_optimizer_state),
            "seed": self.steps.seed_in_use(),
            **(schedule_properties(self.schedule) if self.schedule is not None else self.planned),
            **self.run.origin.progress_properties(trainer),
            **(properties or {}),
        }
        return write_ort_checkpoint(session, path, include_optimizer_state=include_optimizer_state, properties=values)

    def _learning_rate(self, trainer: Any) -> dict[str, float]:
        """``{"lr": ...}``: the rate of the optimizer that updates (under a torch optimizer, its own), or nothing."""
        if not self.hybrid:
            return {"lr": float(self.live.session.get_lr())}
        optimizers = getattr(trainer, "optimizers", None) or []
        return {"lr": float(optimizers[0].param_groups[0]["lr"])} if optimizers else {}

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None) -> Path:
        """Write the eval graph with the current weights, keeping `outputs` (None: the model's own)."""
        names = list(outputs) if outputs is not None else list(self.artifacts.manifest.outputs)
        return export_inference(self.live.evaluator.session, path, names)

    def to_onnx(self, file_path: Any, options: dict[str, Any]) -> Path:
        """Lightning's ``to_onnx``: the inference model at `file_path`; torch.onnx `options` are refused."""
        if not isinstance(file_path, (str, os.PathLike)) or options:
            given = f" and torch.onnx.export options {sorted(options)}" if options else ""
            raise ConfigurationError(
                f"to_onnx writes the eval graph ORT trains, with its current weights, to a file: it takes a path and "
                f"no export options, but got file_path={file_path!r}{given}; call "
                "module.export_inference_model(path, outputs=...) to choose the outputs."
            )
        return self.export_inference_model(file_path, None)

    def dump(self, checkpoint: dict[str, Any], trainer: Any) -> None:
        """Store ORT's state (weights, and the optimizer's unless hybrid), the progress, the identity."""
        self.check_parameters(trainer)
        origin = self.run.origin
        state = state_bytes(self.live.session, include_optimizer_state=not self.hybrid)
        checkpoint[ORT_STATE_KEY] = state
        checkpoint[PROGRESS_KEY] = {**origin.lightning_record(self.steps.seed_in_use()),
                                    STATE_DIGEST_KEY: state_digest(state)}
        checkpoint[IDENTITY_KEY] = {**identity_of(self.artifacts), "metrics": metric_names(self.metrics)}

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Replace the running session with a ``.ckpt``'s state and continue the run it records.

        Raises:
            CheckpointError: for a ``.ckpt`` without ORT state, of other artifacts, with a damaged record,
                or metrics it was trained with and that are not passed again.
        """
        artifacts, source = self.artifacts, "The Lightning checkpoint"
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
            check_metrics(stored.get("metrics", {}), bool(self.metrics), source=source)
        with restored_state(state, digest=progress.get(STATE_DIGEST_KEY)) as path, _unreadable_state(source):
            if stored is None:  # NOTE: a .ckpt written before the identity was stored: check its parameters
                check_identity(
                    identity_of_state(path, artifacts), identity_of(artifacts), source=source,
                    folder=artifacts.directory,
                )
            self.live.replace(checkpoint=path)
        self.start_from(origin)
        self.run.restored = True


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
    """`kwargs` for ``load_from_checkpoint``, with ``artifacts=`` found beside a moved ``.ckpt`` or above it.

    Stored hyper-parameters that name code to load are refused unless `kwargs` passes them again.

    Raises:
        CheckpointError: for a file that is no ``.ckpt``, artifacts found nowhere, or stored code not passed again.
    """
    hparams = hyperparameters_of(read_lightning_checkpoint(checkpoint_path))
    if kwargs.get("hparams_file") is None:
        check_code_hyperparameters(hparams, kwargs, source=f"Checkpoint {checkpoint_path}")
    if "artifacts" in kwargs:
        return kwargs
    found = resolve_artifacts(checkpoint_path, hparams)
    return kwargs if found is None else {**kwargs, "artifacts": found}
