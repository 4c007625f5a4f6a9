"""Count how often one batch's training_step and one export_artifacts call switch between package files.

Run as ``python -m tools.file_switches``: it traces the calls (``sys.settrace``) and counts the
moves from one file of ``ort_lightning`` to another, following the code as it runs.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import ort_lightning
from ort_lightning import ORTLightningModule, export_artifacts

PACKAGE = str(Path(ort_lightning.__file__).parent)


@contextmanager
def switches() -> Iterator[list[str]]:
    """Record the package files entered, in order, while the block runs."""
    files: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE):
            if not files or files[-1] != name:
                files.append(name)
            return tracer
        if event == "return" and name.startswith(PACKAGE):
            caller = frame.f_back
            if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
                back = caller.f_code.co_filename
                if files and files[-1] != back:
                    files.append(back)
        return tracer if name.startswith(PACKAGE) else None

    sys.settrace(tracer)
    try:
        yield files
    finally:
        sys.settrace(None)


def report(label: str, files: list[str]) -> None:
    """Print the number of switches and distinct files."""
    print(f"{label}: {max(len(files) - 1, 0)} file switches across {len(set(files))} files")
    if "-v" in sys.argv:
        print("  " + " > ".join(Path(f).relative_to(PACKAGE).as_posix() for f in files))


def main() -> None:
    """Measure a training_step plus its optimizer step, and an export."""
    folder = tempfile.mkdtemp()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with switches() as files:
        artifacts = export_artifacts(model, torch.zeros(2, 4), folder, verify=False)
    report("export_artifacts(verify=False)", files)
    module = ORTLightningModule(artifacts, lr=1e-2)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,))), batch_size=4)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)

    class Probe(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            if trainer.global_step == 1:
                self.context = switches()
                self.files = self.context.__enter__()

        def on_train_batch_end(self, *args: Any) -> None:
            if trainer.global_step == 2:
                self.context.__exit__(None, None, None)
                report("one batch: training_step + optimizer step", self.files)

    trainer.callbacks.append(Probe())
    trainer.fit(module, data)


if __name__ == "__main__":
    main()
