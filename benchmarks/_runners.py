"""The ways to train one model that the benchmark compares, each timed the same way.

Five ways (Lightning + ORT, the same with a torch optimizer, a hand-written ORT loop, Lightning +
torch, a hand-written torch loop), and Lightning + ORT once more with ``threads="off"``: the
baseline that the default thread policy must not be slower than.

A runner's ``run(steps)`` trains on a DataLoader of ``steps + 1`` batches and returns the
``steps`` intervals between consecutive batch ends, in seconds: data loading, the step and,
for the Lightning runners, Lightning's loop and ``self.log`` are all inside an interval.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from onnxruntime.capi._pybind_state import OrtValue, OrtValueVector
from onnxruntime.training.api import CheckpointState, Module, Optimizer

from benchmarks._models import Case
from ort_lightning import ORTLightningModule, TrainingArtifacts

LR = 1e-3

#: The adapter's thread policy in the Lightning + ORT runners (``--threads``).
THREADS = "auto"


def torch_adamw(params: Any) -> torch.optim.Optimizer:
    """The torch runners' and the hybrid runner's optimizer: AdamW, fused (torch's fastest on CPU)."""
    return torch.optim.AdamW(params, lr=LR, fused=True)


class _BatchEndClock(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())


def _intervals(stamps: list[float]) -> list[float]:
    return [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]


class TorchLightning(pl.LightningModule):
    """What a user writes in plain Lightning: the torch model, cross-entropy, AdamW, logging."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.model = case.model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.case.loss(self.model, batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch_adamw(self.parameters())


def _fit(module: pl.LightningModule, loader: Any, *callbacks: pl.Callback) -> list[float]:
    """One epoch over `loader`; the intervals between batch ends. `callbacks`: more of them (probes)."""
    clock = _BatchEndClock()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[clock, *callbacks],
    )
    trainer.fit(module, loader)
    return _intervals(clock.stamps)


class LightningORT:
    """ORTLightningModule under a Trainer: the product.

    A constant lr, as the torch runners' plain AdamW has: no scheduler on either side.
    """

    label = "Lightning + ORT"
    #: The warm-up fit is long enough for the thread policy to measure its candidates, as in a
    #: user's long fit; the timed fits, short, keep what it chose.
    warmup = 120

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant", threads=THREADS)

    def run(self, steps: int) -> list[float]:
        return _fit(self.module, self.case.loader(steps + 1))

    def describe(self) -> str:
        """The thread policy's choice after the warm-up, and why."""
        return self.module.thread_policy.reason


class LightningORTHybrid(LightningORT):
    """ORTLightningModule with a torch optimizer: ORT's forward and backward, torch's fused AdamW update."""

    label = "Lightning + ORT-hybrid"

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.module = ORTLightningModule(artifacts, optimizer=torch_adamw, lr_scheduler="constant", threads=THREADS)


class LightningORTOff(LightningORT):
    """ORTLightningModule with ``threads="off"`` (both thread pools as they are): the default policy's baseline.

    The same module as `LightningORT` in the same run, so that "the default never slows a step"
    is a ratio of one run (under ``--threads off`` both runners are the same).
    """

    label = "Lightning + ORT, threads=off"

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.module = ORTLightningModule(artifacts, lr=LR, lr_scheduler="constant", threads="off")


class LightningTorch:
    """The same model in plain torch under the same Trainer: what a user would pick instead."""

    label = "Lightning + torch"

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.module = TorchLightning(case)

    def run(self, steps: int) -> list[float]:
        return _fit(self.module, self.case.loader(steps + 1))


class ORTLoop:
    """A hand-written ONNX Runtime loop over the same DataLoader, on ORT's fastest path.

    Batches are wrapped by DLPack (no copy), the loss stays in ORT, nothing is logged: the
    floor that the adapter's overhead is measured against.
    """

    label = "ORT loop"

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.state = CheckpointState.load_checkpoint(str(artifacts.checkpoint))
        self.module = Module(str(artifacts.training_model), self.state, str(artifacts.eval_model), device="cpu")
        self.optimizer = Optimizer(str(artifacts.optimizer_model), self.module)
        self.optimizer.set_learning_rate(LR)
        self.module.train()
        # ORT's two compute calls of a step (`python -m benchmarks.overhead` times them).
        self.train_step = self.module._model.train_step_with_ort_values
        self.update = self.optimizer._optimizer.optimizer_step

    def __del__(self) -> None:
        # NOTE: ORT 1.19.2's C++ Module writes into its CheckpointState when it is destroyed. The bound calls
        # keep it alive past the Python Module, which holds the state, so they go first; left to the
        # attributes' order, the state went first and glibc aborted the process at its end, one run in ten.
        self.train_step = self.update = None

    def run(self, steps: int) -> list[float]:
        train, update = self.train_step, self.update
        reset = self.module._model.lazy_reset_grad
        wrap = OrtValue.from_dlpack
        stamps = []
        for batch in self.case.loader(steps + 1):
            inputs = OrtValueVector()
            for tensor in batch:
                # NOTE: ORT 1.19.2 reads bool tensors from DLPack only as 8-bit unsigned ones.
                flag = tensor.dtype == torch.bool
                inputs.push_back(wrap((tensor.view(torch.uint8) if flag else tensor).__dlpack__(), flag))
            fetches = OrtValueVector()
            train(inputs, fetches)
            update()
            reset()
            stamps.append(time.perf_counter())
        return _intervals(stamps)


class TorchLoop:
    """A hand-written torch loop: forward, loss, backward, AdamW step, zero_grad."""

    label = "torch loop"

    def __init__(self, case: Case, artifacts: TrainingArtifacts) -> None:
        self.case = case
        self.model = case.model()
        self.optimizer = torch_adamw(self.model.parameters())

    def run(self, steps: int) -> list[float]:
        stamps = []
        for batch in self.case.loader(steps + 1):
            self.case.loss(self.model, batch).backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
        return _intervals(stamps)


RUNNERS = {"lightning-ort": LightningORT, "lightning-ort-off": LightningORTOff,
           "lightning-ort-hybrid": LightningORTHybrid, "ort-loop": ORTLoop, "lightning-torch": LightningTorch,
           "torch-loop": TorchLoop}


def export(case: Case, directory: Path, *, verify: bool = True) -> TrainingArtifacts:
    """Export `case`'s model (seed 0, the torch runners' initial weights too) with AdamW, verified unless told not."""
    from ort_lightning import export_artifacts

    loss = None if case.returns_loss else "cross_entropy"
    return export_artifacts(case.model(), case.example(), directory / case.name, loss=loss, verify=verify)
