"""The optimizer step path against plain torch: dropped micro-batches, seeds and ORT's random stream."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning import ORTLightningModule
from tests.conftest import Exported, blobs
from tests.helpers import quiet_trainer

BATCH, STEPS = 16, 12


def _loader() -> DataLoader:
    x, y = blobs(8 * BATCH, seed=5)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


#: The quiet Trainer with this file's settings; a call's options override them.
_trainer = partial(quiet_trainer, accelerator="cpu", num_sanity_val_steps=0)


class _RunsThenDrops(ORTLightningModule):
    """Runs ORT's graph for every micro-batch (the base training_step), then drops every third one."""

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 2 else loss


@pytest.mark.parametrize("accumulate", [2, 3], ids=["accumulate-2", "accumulate-3"])
def test_a_micro_batch_that_ran_the_graph_and_returned_none_leaves_no_gradient(
    mlp_adamw: Exported, accumulate: int
) -> None:
    module = _RunsThenDrops(mlp_adamw.artifacts, lr=0.01, lr_scheduler="constant")
    _trainer(max_steps=STEPS, accumulate_grad_batches=accumulate).fit(module, _loader())
    # plain torch: the forward of a dropped micro-batch runs, its backward never does; as in
    # Lightning, a window ends at the epoch's end and each micro-batch's loss is divided by N
    reference = mlp_adamw.reference()
    _torch_windows(reference, accumulate, dropped=lambda index: index % 3 == 2)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(module.get_parameter(name).detach(), parameter.detach(), rtol=0, atol=1e-5)
    # the control: keeping the dropped micro-batches' gradients lands elsewhere
    kept = mlp_adamw.reference()
    _torch_windows(kept, accumulate, dropped=lambda index: False)
    pairs = zip(kept.parameters(), reference.parameters(), strict=True)
    assert max((a - b).abs().max().item() for a, b in pairs) > 1e-3


def _torch_windows(model: torch.nn.Module, accumulate: int, *, dropped: Callable[[int], bool]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    batches = list(_loader())
    steps = 0
    while steps < STEPS:
        for start in range(0, len(batches), accumulate):
            for index in range(start, min(start + accumulate, len(batches))):
                x, y = batches[index]
                loss = F.cross_entropy(model(x), y) / accumulate
                if not dropped(index):
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps == STEPS:
                return
