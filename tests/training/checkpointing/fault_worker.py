"""Kill training with SIGKILL at random moments; check that the last checkpoint always resumes.

Run by tests/training/checkpointing/test_fault.py as
``python tests/training/checkpointing/fault_worker.py ARTIFACTS OUT --trials N --seed S``.
Importing torch, Lightning and ONNX Runtime takes seconds, so this process imports them once
and forks a child per trial (no ORT session exists in the parent when it forks). Each trial:

1. a trainer child resumes from ``last.ortckpt`` (or starts) and trains, saving an ORT
   checkpoint after every step, until the parent kills it after a random delay;
2. the parent looks for traces of an interrupted write (temp files, a two-digest sidecar);
3. a verifier child loads every visible checkpoint file; a CheckpointError fails the trial.

A run that reaches its last step is compared bit for bit with an uninterrupted reference run,
and a new run starts. Finally a child completes the current run from its last checkpoint.
Prints one JSON line of counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTCheckpoint, ORTLightningModule
from ort_lightning.errors import CheckpointError
from ort_lightning.ort import runtime as _ort
from ort_lightning.storage.atomic import verify_digest
from ort_lightning.storage.temps import TEMP_SUFFIX

STEPS = 300
BATCH = 16
SCHEDULE = dict(lr=0.02, warmup_steps=20, total_steps=STEPS)
CORRUPT_EXIT = 3


def _data(start: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 4, generator=generator)
    y = torch.randint(0, 3, (STEPS * BATCH,), generator=generator)
    return DataLoader(TensorDataset(x[start * BATCH:], y[start * BATCH:]), batch_size=BATCH, shuffle=False)


def _fit(artifacts: Path, run: Path | None, out: Path) -> None:
    last = None if run is None else run / "last.ortckpt"
    module = ORTLightningModule(artifacts, checkpoint=last if last and last.exists() else None, **SCHEDULE)
    start = module.start_progress["global_step"]
    if start < STEPS:
        callbacks = [] if run is None else [ORTCheckpoint(run, every_n_train_steps=1, every_n_epochs=None)]
        trainer = L.Trainer(
            max_epochs=1, callbacks=callbacks, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=run is not None, default_root_dir=out,
        )
        trainer.fit(module, _data(start))
    np.savez(out, **{name: t.detach().numpy() for name, t in module.state_dict().items()})


def _verify(run: Path) -> None:
    # The digest check and ORT's own reader; the next trial then resumes from last.ortckpt.
    for path in sorted(run.glob("*.ortckpt")):
        verify_digest(path)
        try:
            _ort.checkpoint_summary(path)
        except _ort.CHECKPOINT_READ_ERRORS as error:
            raise CheckpointError(f"ONNX Runtime cannot read {path}: {error}") from error


def _child(work: Callable[[], None]) -> int:
    """Fork; run `work` in the child. Returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        torch.set_num_threads(1)
        work()
    except CheckpointError as error:
        print(f"verify: {error}", file=sys.stderr)
        code = CORRUPT_EXIT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _interrupted_write(run: Path) -> tuple[bool, bool]:
    temps = any(run.glob(f".*{TEMP_SUFFIX}"))
    dual = any(len(p.read_text().splitlines()) > 1 for p in run.glob("*.sha256") if p.is_file())
    return temps, dual


def _same(a: Path, b: Path) -> bool:
    with np.load(a) as left, np.load(b) as right:
        return left.files == right.files and all(np.array_equal(left[k], right[k]) for k in left.files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # Lightning's advice about val loops and workers, per child
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    artifacts, out = args.artifacts, args.out
    started = time.perf_counter()
    if _wait(_child(lambda: _fit(artifacts, None, out / "reference.npz"))) != 0:
        raise SystemExit("the uninterrupted reference run failed")
    counts = dict(trials=0, killed=0, finished_before_kill=0, temp_files=0, dual_digest=0, verify_failures=0,
                  runs_completed=0, runs_identical=0)
    run_index = 0
    run = out / f"run{run_index}"
    for _ in range(args.trials):
        counts["trials"] += 1
        pid = _child(lambda run=run: _fit(artifacts, run, out / f"{run.name}.npz"))
        time.sleep(rng.uniform(0.0, args.max_delay))
        os.kill(pid, signal.SIGKILL)
        code = _wait(pid)
        counts["killed" if code == -signal.SIGKILL else "finished_before_kill"] += 1
        temps, dual = _interrupted_write(run) if run.exists() else (False, False)
        counts["temp_files"] += temps
        counts["dual_digest"] += dual
        if run.exists() and _wait(_child(lambda run=run: _verify(run))) != 0:
            counts["verify_failures"] += 1
        if code == 0:  # the run reached its last step before the kill
            counts["runs_completed"] += 1
            counts["runs_identical"] += _same(out / f"{run.name}.npz", out / "reference.npz")
            run_index += 1
            run = out / f"run{run_index}"
    if _wait(_child(lambda: _fit(artifacts, run, out / f"{run.name}.npz"))) != 0:
        raise SystemExit(f"resuming {run} from its last checkpoint failed")
    counts["runs_completed"] += 1
    counts["runs_identical"] += _same(out / f"{run.name}.npz", out / "reference.npz")
    counts["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
