"""`LiveSession`: a module's running ORT session, and the one way to change it.

A device, thread setting, restored ``.ckpt``, fresh optimizer state or new values all go through
`LiveSession.replace`, which keeps the module's parameters, the step path and the fit's optimizers
in step with the new session. Values alone are copied in place; anything else rebuilds ORT's
objects, one session's memory at a time (the running one closed first).

Example::

    >>> import dataclasses, tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> live, weight = module.live_session, module.weight
    >>> live.replace(settings=dataclasses.replace(live.settings, spinning=False))  # rebuilt
    True
    >>> live.replace(values={"weight": torch.ones(3, 4), "bias": torch.zeros(3)})  # copied in place
    False
    >>> module.ort_session.spinning, module.weight is weight, bool(module.weight.sum() == 12)
    (False, True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.artifacts.state import check_values, state_specs
from ort_lightning.ort import runtime as _ort
from ort_lightning.ort.runtime import SessionSettings
from ort_lightning.training.session.session_views import SessionViews, snapshot, state_values
from ort_lightning.training.session.step import StepPath

__all__ = ["LiveSession", "SessionFollower"]


class SessionFollower(Protocol):
    """What works on the running session and must follow it when it is replaced (an optimizer)."""

    def follow(self, session: _ort.TrainingSession) -> None:
        """Work on `session` from now on."""


class LiveSession:
    """The running ORT session of one module: built once, changed only by `replace`.

    Args:
        module: the module the ORT parameters are registered on.
        artifacts: what to build from.
        steps: the module's step path; it follows every build.
        optimizers: returns the trainer's optimizers; those with ``follow(session)`` follow every rebuild.
        settings: how the session runs (device, threads, the eval graph, custom operators).
        checkpoint: the ORT checkpoint to start from; None means the artifacts' own.
        values: name -> tensor for every state tensor, in place of the checkpoint's weights.
    """

    def __init__(
        self, module: torch.nn.Module, artifacts: TrainingArtifacts, steps: StepPath, *,
        optimizers: Callable[[], Iterable[Any]], settings: SessionSettings,
        checkpoint: Path | _ort.HeldState | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> None:
        self.module, self.artifacts, self.steps, self.optimizers = module, artifacts, steps, optimizers
        self._build(checkpoint=checkpoint, settings=settings, values=values)

    @property
    def session(self) -> _ort.TrainingSession:
        """ORT's objects now running (another object after each rebuild)."""
        return self.views.session

    @property
    def settings(self) -> SessionSettings:
        """How the running session runs; ``replace(settings=dataclasses.replace(live.settings, ...))`` changes it."""
        return self.views.session.settings

    def replace(
        self, *, settings: SessionSettings | None = None, values: Mapping[str, Any] | None = None,
        checkpoint: Path | _ort.HeldState | None = None, include_optimizer_state: bool = True,
    ) -> bool:
        """Change the running session between two optimizer steps; the module, step path and optimizers follow.

        Args:
            settings: how to run from now on; None keeps the running ones.
            values: name -> tensor for every state tensor, copied in last (no rebuild if nothing else changes).
            checkpoint: an ORT checkpoint to rebuild from instead of the running state.
            include_optimizer_state: False starts a fresh optimizer state, as a new ``fit`` does.

        Returns:
            Whether ORT's objects were rebuilt.

        Raises:
            ConfigurationError: for `values` with missing, unexpected or misshapen tensors.
        """
        session = self.session
        current = session.settings
        wanted = current if settings is None else settings
        # NOTE: views that something replaced with copies (Lightning's spawn launcher) hold the module's values.
        detached = checkpoint is None and not self.views.attached(self.module)
        if detached and values is None:
            values = state_values(self.module, self.artifacts)
        if wanted == current and checkpoint is None and include_optimizer_state:
            if detached:
                self._reattach()
            if values is not None:
                self.load(values)
            return False
        with contextlib.ExitStack() as stack:
            if checkpoint is None and values is not None and not include_optimizer_state:
                # NOTE: every value given and a fresh optimizer state: nothing of the running state is kept, so the
                # build starts from the nominal checkpoint (names and shapes) where there is one, as a new module does.
                checkpoint = self.artifacts.nominal_checkpoint
            if checkpoint is None and include_optimizer_state and values is None and wanted.device == current.device:
                # NOTE: other threads or graphs on the same device: ORT's state itself goes over (weights, step,
                # moments), no snapshot file and none of its memory.
                self._rebuild(session.handover(), wanted, current, None)
                return True
            if checkpoint is None:
                # NOTE: a rebuild keeps the training progress of the running session (weights, step, moments).
                saved = stack.enter_context(snapshot(session, include_optimizer_state=include_optimizer_state))
                self._rebuild(saved, wanted, current, values)
                return True
            # NOTE: a given checkpoint may be refused (damaged, another model's): the running session stays until the
            # new one is built, so that a refusal leaves the module as it was; a snapshot is the session's own file.
            self._build(checkpoint=checkpoint, settings=wanted, values=values)
            session.close()
        return True

    @property
    def evaluator(self) -> SessionViews:
        """The running views, with the eval graph (rebuilt with it once, after a build for training alone)."""
        if not self.views.session.evaluation:
            self.replace(settings=dataclasses.replace(self.settings, evaluation=True))
        return self.views

    def use_threads(self, spinning: bool, intra_op_threads: int) -> None:
        """Run ORT with these thread settings from the next step on (the thread policy's route to `replace`)."""
        settings = self.settings
        if (settings.spinning, settings.intra_op_threads) != (spinning, intra_op_threads):
            self.replace(settings=dataclasses.replace(settings, spinning=spinning, intra_op_threads=intra_op_threads))

    @torch.no_grad()
    def load(self, values: Mapping[str, Any]) -> None:
        """Copy `values` into ORT's memory through the views; nothing rebuilt.

        Raises:
            ConfigurationError: for missing, unexpected or misshapen values.
        """
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        for name, value in check_values(values, state_specs(self.artifacts)).items():
            tensors[name].copy_(value)

    def _build(self, *, checkpoint: Path | _ort.HeldState | None, settings: SessionSettings,
               values: Mapping[str, Any] | None = None) -> None:
        """The one place ORT's objects are built; everything that works on them follows."""
        self.views = SessionViews(self.module, self.artifacts, settings=settings, checkpoint=checkpoint, values=values)
        self._follow()

    def _rebuild(
        self, saved: Path | _ort.HeldState, wanted: SessionSettings, current: SessionSettings,
        values: Mapping[str, Any] | None,
    ) -> None:
        """Build from `saved` with the `wanted` settings, the running session closed first.

        Should the build fail, the running state comes back from `saved` with the `current` settings.
        """
        self.session.close()
        try:
            self._build(checkpoint=saved, settings=wanted, values=values)
        except BaseException:
            self._build(checkpoint=saved, settings=current)
            raise

    def _reattach(self) -> None:
        """Register ORT's memory on the module again (something replaced the views with copies)."""
        self.views.reattach(self.module)
        self._follow()

    def _follow(self) -> None:
        """Point the step path and the fit's optimizers at the views just built (the one place they are re-pointed)."""
        views = self.views
        self.steps.attach(views.session, views.gradients, views.train_inputs)
        for optimizer in self.optimizers():
            if hasattr(optimizer, "follow"):
                optimizer.follow(views.session)
