"""Kill a run that writes both Lightning ``.ckpt`` and ORT files; resume each kill both ways.

Run by tests/training/checkpointing/test_faults_checkpoints.py as
``python tests/training/checkpointing/resume_worker.py ARTIFACTS OUT --kills N --seed S``.
As tests/training/checkpointing/fault_worker.py does, this process imports torch, Lightning and ONNX Runtime once and
forks a child per run (no ORT session exists in the parent when it forks). Each trial:

1. a trainer child continues the run with ``Trainer.fit(ckpt_path="last")`` under
   ``ModelCheckpoint(save_last=True)`` and ``ORTCheckpoint``, both saving after every step, until
   the parent kills it after a random delay, mostly counted from its first step (so kills land in
   steps, in either write, between them), sometimes from its start (in start-up and restore);
2. on a copy of the run folder, one child resumes with ``Trainer.fit(ckpt_path="last")``, another
   with ``ORTLightningModule(..., checkpoint=last.ortckpt)``; each compares its parameters where it
   starts and where it ends with an uninterrupted run's at the same steps, bit for bit; a resume
   that fails is reported with its stderr and the files the kill left (``misses``).

Last, the run is finished, started once more and resumed both ways: the state that a kill just after
the last step's writes leaves, which random kills meet about once in 40.

The run is one epoch of `STEPS` batches; each resume's loader starts at the batch its checkpoint
stopped before (`FromSampler`), so that both resume paths see the batches the uninterrupted run
saw. Prints one JSON line of counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import select
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from ort_lightning.storage.temps import TEMP_MARK

# NOTE: a script beside fault_worker.py when a test runs it, a module of `tests` when pytest collects it.
if __package__:
    from tests.training.checkpointing.fault_worker import _child, _wait
else:
    from fault_worker import _child, _wait

STEPS = 24
BATCH = 16
SCHEDULE: dict[str, Any] = dict(lr=0.02, warmup_steps=4, total_steps=STEPS, threads="off")


class FromSampler(Sampler[int]):
    """Batches ``first, first + 1, ..., STEPS - 1`` of one epoch, `length` long as Lightning counts it.

    NOTE: Lightning restores a mid-epoch ``ckpt_path`` resume's batch count but restarts a plain
    loader from its first batch; starting the loader where the ``.ckpt`` stopped makes the resumed
    run see the batches the uninterrupted one saw (a stateful loader would do the same in a real run).
    """

    def __init__(self, first: int, length: int) -> None:
        self.first, self.length = first, length

    def __iter__(self) -> Any:
        return iter(range(self.first, STEPS))

    def __len__(self) -> int:
        return self.length


def _loader(first: int, length: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, BATCH, 4, generator=generator)
    y = torch.randint(0, 3, (STEPS, BATCH), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=None, sampler=FromSampler(first, length))


def _resumed_loader(run: Path) -> DataLoader:
    """The loader of a ``ckpt_path="last"`` fit in `run`: from the batch after ``last.ckpt``'s step, in one epoch."""
    last = run / "last.ckpt"
    first = int(torch.load(last, weights_only=True)["global_step"]) if last.exists() else 0
    return _loader(first, STEPS)


def _trainer(callbacks: list[Callback], root: Path) -> L.Trainer:
    return L.Trainer(
        max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), default_root_dir=root,
    )


def _values(module: ORTLightningModule) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in module.state_dict().items()}


class Record(Callback):
    """The parameters after every optimizer step (the uninterrupted reference run)."""

    def __init__(self) -> None:
        self.steps: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.steps.update({f"0/{k}": v for k, v in _values(pl_module).items()})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.steps.update({f"{trainer.global_step}/{k}": v for k, v in _values(pl_module).items()})


def _reference(artifacts: Path, out: Path) -> None:
    record = Record()
    _trainer([record], out).fit(ORTLightningModule(artifacts, **SCHEDULE), _loader(0, STEPS))
    np.savez(out / "reference.npz", **record.steps)


def _run_callbacks(run: Path, *, saving: bool) -> list[Callback]:
    if not saving:  # NOTE: the lookup of "last" needs the ModelCheckpoint; this one writes nothing
        return [ModelCheckpoint(dirpath=run, save_top_k=0, save_last=False)]
    return [ModelCheckpoint(dirpath=run, save_top_k=0, save_last=True, every_n_train_steps=1),
            ORTCheckpoint(run, every_n_train_steps=1)]


class Started(Callback):
    """Tells the parent, through a pipe, that the first step is about to run (so kills land in training)."""

    def __init__(self, pipe: int | None) -> None:
        self.pipe = pipe

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.pipe is not None:
            os.write(self.pipe, b"1")


def _train(artifacts: Path, run: Path, pipe: int | None = None) -> None:
    module = ORTLightningModule(artifacts, **SCHEDULE)
    callbacks = [*_run_callbacks(run, saving=True), Started(pipe)]
    _trainer(callbacks, run).fit(module, _resumed_loader(run), ckpt_path="last")


def _same(values: dict[str, np.ndarray], reference: Any, step: int) -> bool:
    return all(np.array_equal(value, reference[f"{step}/{name}"]) for name, value in values.items())


class Start(Callback):
    """Where a resumed fit starts: its step and parameters after Lightning restored the ``.ckpt``.

    NOTE: a ``.ckpt`` written when its run ended (Lightning's ``on_train_end`` save of a run resumed
    after its last step) holds a finished epoch: ``fit`` restores it and returns without a step, and
    ``on_train_start`` never runs; the start is then the restored state, read when ``fit`` ends.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.values: dict[str, np.ndarray] = {}
        self.trained = False

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.step, self.values, self.trained = trainer.global_step, _values(pl_module), True

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.step is None:
            self.step, self.values = trainer.global_step, _values(pl_module)


def _resume(artifacts: Path, run: Path, out: Path, way: str) -> None:
    """Finish the run in `run` one way; write where it started and whether both ends equal the reference."""
    with np.load(out / "reference.npz") as reference:
        if way == "ckpt_path":
            module, start = ORTLightningModule(artifacts, **SCHEDULE), Start()
            _trainer([*_run_callbacks(run, saving=False), start], run).fit(
                module, _resumed_loader(run), ckpt_path="last")
            assert start.step is not None, "fit ended before it started"
            step, begun, ended = start.step, _same(start.values, reference, start.step), not start.trained
        else:
            last = run / "last.ortckpt"
            module = ORTLightningModule(artifacts, checkpoint=last if last.exists() else None, **SCHEDULE)
            step = module.start_progress["global_step"]
            begun, ended = _same(_values(module), reference, step), step >= STEPS
            if step < STEPS:
                _trainer([], run).fit(module, _loader(step, STEPS - step))
        result = {"step": step, "start_equal": begun, "end_equal": _same(_values(module), reference, STEPS),
                  "ended": ended}
    (out / f"{way}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=1.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice about workers and empty folders, per child
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rng, artifacts, out = random.Random(args.seed), args.artifacts, args.out
    started = time.perf_counter()
    reference = _child(lambda: _reference(artifacts, out))
    counts: dict[str, Any] = dict(trials=0, killed=0, finished_before_kill=0, unresumable=0, start_steps=[],
                                  ckpt_path_equal=0, checkpoint_equal=0, ortckpt_newer=0, misses=[],
                                  ended_run_resumes=0, ortckpt_versioned=0)
    run_index, run = 0, out / "run0"
    # NOTE: up to 5 trials a kill: on busy cores a run often finishes before its random delay is up (41 of 61 once,
    # leaving 19 kills at a cap of 3 a kill); the loop ends as soon as `kills` have landed.
    while counts["killed"] < args.kills and counts["trials"] < 5 * args.kills:
        counts["trials"] += 1
        code = _train_and_kill(artifacts, run, rng, args.max_delay, counts)
        if reference is not None and _wait(reference) != 0:
            raise SystemExit("the uninterrupted reference run failed")
        # NOTE: the reference run (needed from the first resume on) runs beside the first trial's trainer
        reference = None
        _collect(_start_checks(artifacts, run, out, counts["trials"]), counts)
        if code == 0:
            run_index += 1
            run = out / f"run{run_index}"
    counts["temps_left"] = _temps_after_finishing(artifacts, run)
    _resume_ended_run(artifacts, run, out, counts)
    counts["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(counts))


def _train_and_kill(artifacts: Path, run: Path, rng: random.Random, max_delay: float, counts: dict[str, Any]) -> int:
    """Continue the run in `run` in a child, kill it after a random delay; return its exit code."""
    reader, writer = os.pipe()
    pid = _child(lambda: _train(artifacts, run, writer))
    os.close(writer)
    # NOTE: most kills land in the training steps (and their writes), some in start-up and restore
    if rng.random() < 0.8:
        select.select([reader], [], [], 120)
    os.close(reader)
    time.sleep(rng.uniform(0.0, max_delay))
    signal_sent = _kill(pid)
    code = _wait(pid)
    counts["killed" if signal_sent and code == -signal.SIGKILL else "finished_before_kill"] += 1
    counts["ortckpt_newer"] += _ortckpt_newer(run)
    return code


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _ortckpt_newer(run: Path) -> bool:
    """Whether the kill left ``last.ortckpt`` newer than ``last.ckpt`` (the case "last" used to fail on)."""
    ort, lightning = run / "last.ortckpt", run / "last.ckpt"
    return ort.exists() and (not lightning.exists() or ort.stat().st_mtime_ns > lightning.stat().st_mtime_ns)


def _listing(run: Path) -> list[str]:
    """The files a kill left in `run`: name, size, and a link's target (what a miss is explained by)."""
    if not run.exists():
        return []
    return [f"{path.name} -> {os.readlink(path)}" if path.is_symlink() else f"{path.name} {path.stat().st_size}"
            for path in sorted(run.iterdir())]


def _logged(stderr: Path, work: Any) -> None:
    """Run `work` with this child's stderr (its traceback, if it fails) going to the file `stderr`."""
    with stderr.open("w") as stream:
        os.dup2(stream.fileno(), 2)
    work()


class Checks(NamedTuple):
    """The two resumes of one trial, running: their pids by way, and the files the kill left."""

    trial: int
    out: Path
    children: dict[str, int]
    listing: list[str]


def _start_checks(artifacts: Path, run: Path, out: Path, trial: int) -> Checks:
    """Resume copies of `run` both ways at once, in two children that `_collect` waits for."""
    children = {}
    for way in ("ckpt_path", "checkpoint"):
        copy = out / f"copy-{way}"
        shutil.rmtree(copy, ignore_errors=True)
        if run.exists():
            shutil.copytree(run, copy, symlinks=True)
        else:
            copy.mkdir()
        (out / f"{way}.json").unlink(missing_ok=True)
        children[way] = _child(lambda copy=copy, way=way: _logged(
            out / f"{way}.stderr", lambda: _resume(artifacts, copy, out, way)))
    return Checks(trial, out, children, _listing(run))


def _collect(checks: Checks, counts: dict[str, Any]) -> None:
    """Wait for one trial's resumes and count what each found.

    A resume that fails is reported with its stderr and the files the kill left, so that a miss explains itself.
    """
    for way, pid in checks.children.items():
        _count(way, _wait(pid), checks, counts)
    # NOTE: a run resumed through ckpt_path goes on writing last.ortckpt: a last-v1.ortckpt beside it
    # would leave last.ortckpt, the file a checkpoint= resume takes, behind for good
    counts["ortckpt_versioned"] += any(name.startswith("last-v") and ".ortckpt" in name for name in checks.listing)


def _count(way: str, code: int, checks: Checks, counts: dict[str, Any]) -> None:
    """Count one resume's outcome (a failed one is reported as a miss)."""
    result = checks.out / f"{way}.json"
    if code != 0 or not result.exists():
        counts["unresumable"] += 1
        stderr = (checks.out / f"{way}.stderr").read_text(errors="replace")[-4000:]
        counts["misses"].append({"trial": checks.trial, "way": way, "exit": code, "files": checks.listing,
                                 "stderr": stderr})
        print(f"unresumable by {way}: trial {checks.trial} (exit {code}); files at the kill: {checks.listing}\n"
              f"{stderr}", file=sys.stderr)
        return
    outcome = json.loads(result.read_text())
    print(f"trial {checks.trial} {way}: {outcome}", file=sys.stderr)
    counts["start_steps"].append(outcome["step"])
    counts[f"{way}_equal"] += outcome["start_equal"] and outcome["end_equal"]
    counts["ended_run_resumes"] += way == "ckpt_path" and outcome["ended"]


def _temps_after_finishing(artifacts: Path, run: Path) -> int:
    """Finish the current run in place; count the package's temporary files left in its folder."""
    if _wait(_child(lambda: _train(artifacts, run))) != 0:
        raise SystemExit(f"finishing {run} with ckpt_path='last' failed")
    return sum(TEMP_MARK in path.name for path in run.iterdir())


def _resume_ended_run(artifacts: Path, run: Path, out: Path, counts: dict[str, Any]) -> None:
    """One more trial, on the state a kill just after the last step's writes leaves (rare among random kills).

    The next start of such a run restores the step-end ``.ckpt``, has no batch left, and ends with
    Lightning's ``on_train_end`` save: a ``last.ckpt`` of a finished epoch, which ``fit(ckpt_path="last")``
    restores and then runs no step. Both ways must resume it, as after any other kill.
    """
    if _wait(_child(lambda: _train(artifacts, run))) != 0:
        raise SystemExit(f"starting the ended run {run} again with ckpt_path='last' failed")
    counts["trials"] += 1
    _collect(_start_checks(artifacts, run, out, counts["trials"]), counts)


if __name__ == "__main__":
    main()
