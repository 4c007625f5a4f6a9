"""Model zoo: real architectures (built here from torch.nn, tiny) export, train under a Trainer and match torch.

Each model needs a legalization rewrite to train at all (LayerNormalization's outputs, HardSwish,
HardSigmoid, GroupNorm, AveragePool under a dynamic batch). Every one is exported at batch 4 and
trained at batch 8; the first step's gradients (read off ORT's gradient buffers before the update)
must be within 1e-3 relative of torch autograd on the same batch, and the loss must fall.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule, export_artifacts
from tests.export.zoo_models import CLASSES, ZOO, Zoo
from tests.helpers import GradientProbe, quiet_trainer, tiered

EXAMPLE_BATCH, TRAIN_BATCH = 4, 8


def _torch_gradients(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    *inputs, labels = batch
    F.cross_entropy(model(*inputs), labels).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


#: What the fast tier runs; the full run trains every model. Each export is verified too: the one step that the
#: verifier compares with torch at 1e-4 beside this test's 1e-3 after a Trainer's first step.
FAST = {"mobilenetv3-block-hardswish-se", "transformer-encoder-padding-mask"}


@pytest.mark.parametrize("zoo", tiered(ZOO, ids=[z.name for z in ZOO], fast=FAST))
def test_zoo_model_trains_and_matches_torch(tmp_path: Path, zoo: Zoo) -> None:
    torch.manual_seed(0)
    model = zoo.build()
    reference = copy.deepcopy(model).train()
    artifacts = export_artifacts(model, zoo.inputs(EXAMPLE_BATCH, 99), tmp_path / zoo.name)
    inputs = zoo.inputs(32, 0)
    labels = torch.randint(0, CLASSES, (32,), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(*inputs, labels), batch_size=TRAIN_BATCH, shuffle=False)
    probe = GradientProbe()
    trainer = quiet_trainer(max_epochs=8, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(ORTLightningModule(artifacts, lr=1e-2), loader)

    expected = _torch_gradients(reference, next(iter(loader)))
    assert set(probe.grads) == set(expected)
    for name, grad in expected.items():
        scale = max(float(grad.abs().max()), 1e-3 * max(float(g.abs().max()) for g in expected.values()))
        assert float((probe.grads[name] - grad).abs().max()) <= 1e-3 * scale, name
    first_epoch, last_epoch = probe.losses[:4], probe.losses[-4:]
    assert sum(last_epoch) < 0.85 * sum(first_epoch), probe.losses
