"""The runs that tests/ort/test_session_numerics.py compares: ort-lightning's fit, ORT's loop at each session setting.

- `product_run`: ``ORTLightningModule`` on the folder with the product's defaults, under a real,
  quiet ``Trainer``, at a constant learning rate: each step's loss and the parameters after it.
- `setting_runs`: ONNX Runtime's documented loop (`tests.helpers.ort_device_run`) with ORT's
  default ``SessionOptions()`` (what a device runs), and with `session_options` as the product
  builds it at each setting in `SETTINGS`.

A folder whose training graph may write past ORT's buffers is trained in a child process
(``python -m tests.ort.session_numerics_run FOLDER BATCHES OUT``), so that a crash in ORT fails one
test instead of ending the test session; the child saves each run in ``OUT/<run>.npz``.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from ort_lightning.ort.options import session_options
from ort_lightning.training.threads.policy import THREAD_MODES, ThreadPolicy, available_cores
from tests.helpers import DeviceRun, GradientProbe, ort_device_run, quiet_trainer

#: What a device runs: ORT's loop given no session options at all.
ORT_DEFAULTS = "ORT defaults"
#: The product's own run.
PRODUCT = "ORTLightningModule"



def _settings() -> dict[str, dict[str, Any]]:
    """Every ``session_options`` the product builds a training session with, named by where it comes from.

    Read from the thread policy itself: each mode's session (``threads="auto"``, ``"off"``, ``"single"``),
    each ORT pool size the policy's trial measures, and two ``ORTDDPStrategy`` ranks sharing this CPU
    (no spinning, the cores halved).
    """
    settings = {}
    for mode in THREAD_MODES:
        policy = ThreadPolicy(mode)
        settings[mode] = {"spinning": policy.spinning(None), "intra_op_threads": policy.session_threads(None)}
    cores = available_cores()
    for candidate in ThreadPolicy("auto").candidates(cores, session=True):
        if candidate.ort_threads is not None:
            threads = candidate.ort_threads
            settings[f"auto-trial-ort-{threads}-thread"] = {"spinning": True, "intra_op_threads": threads}
    settings["ort_ddp-2-ranks-one-cpu"] = {"spinning": False, "intra_op_threads": max(1, cores // 2)}
    return settings


#: What `_settings` reads, once.
SETTINGS = _settings()

Batch = Sequence[torch.Tensor]


def product_run(folder: Path, batches: Sequence[Batch], *, lr: float) -> tuple[DeviceRun, tuple[bool, int]]:
    """Fit ``ORTLightningModule(folder)`` over `batches`, one step each, with the product's defaults.

    Returns:
        The losses and parameters, and the session's ``(spinning, intra_op_threads)`` at the end of the fit.
    """
    size = len(batches[0][0])
    data = TensorDataset(*(torch.cat(column) for column in zip(*batches, strict=True)))
    probe = GradientProbe()
    module = ORTLightningModule(folder, lr=lr, lr_scheduler="constant")
    trainer = quiet_trainer(max_steps=len(batches), num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(module, DataLoader(data, batch_size=size, shuffle=False))
    state = [*module.named_parameters(), *module.named_buffers()]  # ORT's state holds BatchNorm's statistics too
    parameters = {name: tensor.detach().numpy().copy() for name, tensor in state}
    session = module.ort_session
    return DeviceRun(probe.losses, parameters), (session.spinning, session.intra_op_threads)


def setting_runs(folder: Path, batches: Sequence[Batch], *, lr: float) -> dict[str, DeviceRun]:
    """ONNX Runtime's loop with its default options, then with the product's options at each of `SETTINGS`."""
    runs = {ORT_DEFAULTS: ort_device_run(folder, batches, lr=lr)}
    for name, setting in SETTINGS.items():
        runs[name] = ort_device_run(folder, batches, lr=lr, session_options=session_options(**setting))
    return runs


def save(run: DeviceRun, path: Path) -> None:
    """Write `run` as one ``.npz`` file: the losses under ``losses``, each parameter under its name."""
    np.savez(path, losses=np.asarray(run.losses, dtype=np.float64), **run.parameters)


def load(path: Path) -> DeviceRun:
    """Read what `save` wrote."""
    with np.load(path) as saved:
        parameters = {name: saved[name] for name in saved.files if name != "losses"}
        return DeviceRun([float(value) for value in saved["losses"]], parameters)


def main(argv: Sequence[str] | None = None) -> None:
    """Train FOLDER on the batches saved by ``torch.save`` in BATCHES; write each run into OUT."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("batches", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--lr", type=float, required=True)
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    batches = torch.load(args.batches)
    args.out.mkdir(parents=True, exist_ok=True)
    product, setting = product_run(args.folder, batches, lr=args.lr)
    save(product, args.out / f"{PRODUCT}.npz")
    (args.out / "setting.txt").write_text(f"{setting[0]} {setting[1]}\n")
    for name, run in setting_runs(args.folder, batches, lr=args.lr).items():
        save(run, args.out / f"{name}.npz")


if __name__ == "__main__":
    main()
