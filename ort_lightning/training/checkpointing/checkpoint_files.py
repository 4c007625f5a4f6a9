"""ORT checkpoint files, the ORT state inside Lightning ``.ckpt`` files, and where a run starts.

A ``.ckpt`` carries ORT's whole state as the bytes of an ORT checkpoint file in a uint8 tensor,
so that it still loads with ``torch.load(weights_only=True)``; ``on_load_checkpoint`` rebuilds
the ORT components from them before ``configure_optimizers`` runs.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> folder = Path(tempfile.mkdtemp())
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder / "a", verify=False)
    >>> module = ORTLightningModule(artifacts)
    >>> resumed = ORTLightningModule(folder / "a", checkpoint=module.save_ort_checkpoint(folder / "start.ortckpt"))
    >>> bool(torch.equal(resumed.weight, module.weight))
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ort_lightning.artifacts.state import state_specs, state_summary
from ort_lightning.errors import CheckpointError, ConfigurationError
from ort_lightning.ort import runtime as _ort
from ort_lightning.storage.atomic import atomic_write, verify_digest
from ort_lightning.training.optim.schedules import Progress
from ort_lightning.training.session.session_views import snapshot

if TYPE_CHECKING:
    from ort_lightning.artifacts import TrainingArtifacts

__all__ = [
    "ORT_STATE_KEY",
    "PROGRESS_KEY",
    "Checkpointable",
    "RunOrigin",
    "export_inference",
    "read_checkpoint",
    "read_checkpoint_state",
    "restored_state",
    "state_bytes",
    "state_digest",
    "write_ort_checkpoint",
]

#: Key of the ORT checkpoint bytes in a Lightning checkpoint dict.
ORT_STATE_KEY = "ort_state"
#: Key of the step and epoch counted before this run (a run started with ``checkpoint=``), and the seed.
PROGRESS_KEY = "ort_lightning_progress"

ParameterSummary = list[tuple[str, tuple[int, ...], bool]]


def _version() -> str:
    from ort_lightning._version import __version__

    return __version__


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


@runtime_checkable
class Checkpointable(Protocol):
    """What `ORTCheckpoint` needs of a module: ORT checkpoint files, inference export, pretrained folders, its run."""

    def save_ort_checkpoint(
        self,
        path: str | os.PathLike[str],
        *,
        include_optimizer_state: bool = True,
        properties: dict[str, int | float | str] | None = None,
    ) -> Path:
        """Write an ORT checkpoint file atomically; return its path."""
        ...

    def export_inference_model(self, path: str | os.PathLike[str], outputs: Sequence[str] | None = None) -> Path:
        """Write the inference model; return its path."""
        ...

    def save_pretrained(self, folder: str | os.PathLike[str], *, model: Any = None, merge: bool = False) -> Path:
        """Write the trained model as the folder transformers or peft loads; return the folder."""
        ...

    @property
    def start_progress(self) -> dict[str, int]:
        """Where this run started: Lightning's step and epoch counters."""
        ...

    @property
    def artifacts(self) -> TrainingArtifacts:
        """The artifacts it trains."""
        ...


@dataclass(frozen=True)
class RunOrigin:
    """Where a run starts in the whole training: the step, epoch, schedule start and seed its checkpoint records."""

    step: int = 0
    epoch: int = 0
    schedule: Progress = Progress()
    seed: int | None = None
    properties: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of_file(cls, properties: dict[str, Any]) -> RunOrigin:
        """The origin recorded in an ORT checkpoint's properties (written by `write_ort_checkpoint`)."""
        # NOTE: "next_epoch" says whether the saving epoch had finished; older files have "epoch" only.
        step = int(properties.get("global_step", 0))
        epoch = int(properties.get("next_epoch", properties.get("epoch", 0)))
        with_optimizer = bool(int(properties.get("optimizer_state", 1)))
        seed = int(properties["seed"]) if "seed" in properties else None
        schedule = Progress(step=step, epoch=epoch) if with_optimizer else Progress()
        return cls(step=step, epoch=epoch, schedule=schedule, seed=seed, properties=dict(properties))

    @classmethod
    def of_lightning(cls, record: object) -> RunOrigin:
        """The origin kept in a Lightning checkpoint (`CheckpointError` for a damaged record)."""
        numbers = ("seed", "global_step", "epoch")
        if not isinstance(record, dict) or not all(isinstance(record.get(key, 0), int) for key in numbers):
            raise CheckpointError(
                f"Expected checkpoint[{PROGRESS_KEY!r}] to be a dict of integers {list(numbers)}, but got "
                f"{str(record)[:120]}; the .ckpt was not written by ORTLightningModule or it was edited: resume from "
                "another checkpoint."
            )
        seed = int(record["seed"]) if "seed" in record else None
        return cls(step=int(record.get("global_step", 0)), epoch=int(record.get("epoch", 0)), seed=seed)

    def lightning_record(self, seed: int) -> dict[str, Any]:
        """What a Lightning checkpoint keeps of the origin, with the seed in use."""
        return {"version": _version(), "seed": seed, "global_step": self.step, "epoch": self.epoch}

    def progress_properties(self, trainer: Any) -> dict[str, int]:
        """Where training stands, counted across resumes; outside a Trainer, where the run started (if not at 0)."""
        if trainer is None:  # NOTE: an absent progress reads as the start (`of_file`): nothing to write there
            return {"global_step": self.step, "epoch": self.epoch, "next_epoch": self.epoch} if self.step else {}
        epochs = trainer.fit_loop.epoch_progress.current
        return {"global_step": self.step + trainer.global_step, "epoch": self.epoch + epochs.completed,
                "next_epoch": self.epoch + epochs.processed}


def read_checkpoint(path: Path, artifacts: TrainingArtifacts, *, weights_given: bool = False) -> dict[str, Any]:
    """Verify an ORT checkpoint file (digest, readability, parameters of `artifacts`); return its properties.

    `weights_given` accepts a nominal checkpoint, whose names are then checked against the state.

    Raises:
        CheckpointError: for a damaged file, one of other artifacts, or a nominal one without weights given.
    """
    return read_checkpoint_state(path, artifacts, weights_given=weights_given)[0]


def read_checkpoint_state(
    path: Path, artifacts: TrainingArtifacts, *, weights_given: bool = False
) -> tuple[dict[str, Any], _ort.HeldState]:
    """`read_checkpoint`, and the state it read, for the build that starts from it (one read)."""
    verify_digest(path)
    try:
        held = _ort.read_state(path)
    except _ort.CHECKPOINT_READ_ERRORS as error:
        raise _unreadable(path, error) from error
    try:
        found, properties = held.summary()
    except _ort.CHECKPOINT_READ_ERRORS as error:
        return _read_nominal(path, held, artifacts, error, weights_given=weights_given), held
    expected = state_summary(artifacts)
    problems = _mismatch(found, expected)
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} does not match the artifacts in {artifacts.directory}: its parameters are "
            f"{problems}; pass a checkpoint written while training these artifacts, or the artifacts it came from."
        )
    return properties, held


def _unreadable(path: Path, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"ONNX Runtime cannot read checkpoint {path} ({' '.join(str(error).split())[:160]}); it is not an "
        "ORT checkpoint or it is damaged: resume from another checkpoint file."
    )


def _read_nominal(
    path: Path, held: _ort.HeldState, artifacts: TrainingArtifacts, error: BaseException, *, weights_given: bool
) -> dict[str, Any]:
    """The properties of a checkpoint ORT could not summarize: a nominal one with weights given."""
    try:
        nominal = held.nominal_summary()
    except _ort.CHECKPOINT_READ_ERRORS:
        nominal = None
    if nominal is None:
        raise _unreadable(path, error) from error
    if not weights_given:
        raise CheckpointError(
            f"Checkpoint {path} is a nominal checkpoint (names and shapes, no weights: "
            "export_artifacts(..., nominal_checkpoint=True) writes it), so there is nothing to start from; pass the "
            "weights with ORTLightningModule(..., checkpoint=nominal, values={name: tensor}) (e.g. a fleet server's "
            "values), or pass a complete checkpoint."
        ) from None
    names, properties = nominal
    expected = [spec.name for spec in state_specs(artifacts)]
    if sorted(names) != sorted(expected):
        raise CheckpointError(
            f"Nominal checkpoint {path} names the parameters {sorted(names)}, but the training graph of "
            f"{artifacts.directory} takes {sorted(expected)}; pass the nominal checkpoint written with these artifacts."
        )
    return properties


def state_bytes(session: _ort.TrainingSession, *, include_optimizer_state: bool = True) -> torch.Tensor:
    """The full ORT state (weights, optimizer step and moments) as a uint8 tensor of checkpoint bytes."""
    # NOTE: no properties: a .ckpt keeps the run's progress in its own record, and its ORT bytes must not carry a
    # loaded file's properties to whoever reads them as an ORT checkpoint.
    with snapshot(session, include_optimizer_state=include_optimizer_state, properties={}) as path:
        data = bytearray(path.read_bytes())
    return torch.frombuffer(data, dtype=torch.uint8)


def state_digest(state: torch.Tensor) -> str:
    """The sha256 of the ORT checkpoint bytes that `state_bytes` returned (kept beside them in a ``.ckpt``)."""
    return hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest()


@contextlib.contextmanager
def restored_state(state: object, *, digest: object = None) -> Iterator[Path]:
    """Yield the ORT checkpoint file that `state_bytes` turned into `state`, checked against `digest`.

    Raises:
        CheckpointError: when `state` is not a uint8 tensor, or its bytes are not those the digest was made of.
    """
    if not isinstance(state, torch.Tensor) or state.dtype is not torch.uint8:
        raise CheckpointError(
            f"Expected checkpoint[{ORT_STATE_KEY!r}] to be a uint8 tensor of ORT checkpoint bytes, but got "
            f"{type(state).__name__}; load a checkpoint written by ORTLightningModule."
        )
    data = state.cpu().numpy().tobytes()
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(
            f"The ORT state in checkpoint[{ORT_STATE_KEY!r}] ({len(data)} bytes) does not match the sha256 stored with "
            f"it ({str(digest)[:16]}...): the .ckpt was damaged (flipped or lost bytes) or edited after it was "
            "written; resume from another checkpoint (an earlier .ckpt, or an ORTCheckpoint .ortckpt file)."
        )
    with tempfile.TemporaryDirectory(prefix="ort-lightning-") as folder:
        path = Path(folder) / "state"
        path.write_bytes(data)
        yield path


def write_ort_checkpoint(
    session: _ort.TrainingSession,
    path: str | os.PathLike[str],
    *,
    include_optimizer_state: bool,
    properties: dict[str, int | float | str],
) -> Path:
    """Write `session`'s state to `path` atomically; its properties are this write's only (no earlier run's)."""
    values = {"ort_lightning_version": _version(), **properties}
    atomic_write(
        path, lambda temp: session.save(temp, include_optimizer_state=include_optimizer_state, properties=values)
    )
    return Path(path)


def export_inference(
    session: _ort.TrainingSession, path: str | os.PathLike[str], names: Sequence[str]
) -> Path:
    """Write the eval graph with `session`'s weights as an inference model with outputs `names`."""
    available = session.output_names(training=False)
    unknown = [name for name in names if name not in available]
    if unknown or not names:
        raise ConfigurationError(
            f"Expected `outputs` to name outputs of the eval graph {available}, but got {list(names)}; "
            "pass some of those names, or None for the model's own outputs."
        )
    atomic_write(path, lambda temp: session.export_for_inferencing(temp, list(names)), digest=False)
    return Path(path)
