"""Load damaged artifacts folders and ``.ckpt`` files, each in a child process of its own.

Run by tests/artifacts/test_damaged_files.py as ``python tests/artifacts/damage_worker.py CASES.json``, where the
file lists ``{"id", "action", "folder", "ckpt"}`` objects. Importing torch, Lightning and ONNX
Runtime takes seconds, so this process imports them once and forks a child per case (no ORT
session exists in the parent when it forks): a crash inside ONNX Runtime ends that child only.
Each child builds the module (``"folder"``: ``ORTLightningModule(folder)``; ``"ckpt"``:
``ORTLightningModule.load_from_checkpoint(ckpt, artifacts=folder)``) and fits two steps, so that
a damage that only shows at the first step shows too. Prints one JSON line: per case id, the
outcome (``"error"``, ``"accepted"`` or ``"signal"``), the exception's class, module and message.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule

BATCH = 8


def _load(case: dict[str, Any]) -> ORTLightningModule:
    if case["action"] == "ckpt":
        return ORTLightningModule.load_from_checkpoint(case["ckpt"], artifacts=case["folder"])
    return ORTLightningModule(case["folder"])


def _run(case: dict[str, Any]) -> dict[str, str]:
    try:
        module = _load(case)
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(2 * BATCH, 4, generator=generator),
                             torch.randint(0, 3, (2 * BATCH,), generator=generator))
        trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(data, batch_size=BATCH))
    except BaseException as error:  # noqa: BLE001 - every exception is the result being recorded
        kind = type(error)
        return {"outcome": "error", "class": kind.__name__, "module": kind.__module__,
                "message": " ".join(str(error).split())[:600]}
    return {"outcome": "accepted", "class": "", "module": "", "message": ""}


def _child(case: dict[str, Any], out: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        torch.set_num_threads(1)
        out.write_text(json.dumps(_run(case)))
    finally:
        os._exit(0)


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    results_dir = Path(sys.argv[1]).with_suffix(".results")
    results_dir.mkdir(exist_ok=True)
    warnings.filterwarnings("ignore")  # Lightning's advice about val loops and workers, per child
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    results = {}
    for case in cases:
        out = results_dir / f"{case['id']}.json"
        _, status = os.waitpid(_child(case, out), 0)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            results[case["id"]] = {"outcome": "signal", "class": "", "module": "", "message": f"signal {-code}"}
        else:
            results[case["id"]] = json.loads(out.read_text())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
