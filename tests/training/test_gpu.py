"""CUDA: a real Trainer on the GPU against plain torch, accumulation and clipping included.

Skipped unless torch sees a GPU and ONNX Runtime is the CUDA build. Accumulation scaling and
clipping write ORT's gradient buffers on torch's stream; ORT's optimizer reads them on its own,
after the step path synchronizes torch's stream.
"""

from __future__ import annotations

import pytest
import torch

from ort_lightning import ORTLightningModule
from tests.conftest import Exported
from tests.helpers import RunIf
from tests.training.torch_loop import ADAMW_LR, blob_loader, parity_trainer, torch_train

pytestmark = RunIf(cuda=True)


@pytest.mark.parametrize("accumulate", [1, 2], ids=["no-accumulation", "accumulate-2"])
def test_gpu_fit_with_accumulation_and_clipping_matches_torch(mlp_adamw: Exported, accumulate: int) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=ADAMW_LR, lr_scheduler="constant")
    trainer = parity_trainer(accelerator="gpu", devices=1, accumulate_grad_batches=accumulate, gradient_clip_val=0.1)
    trainer.fit(module, blob_loader())
    assert module.ort_session.device.startswith("cuda")
    assert all(p.is_cuda for p in module.parameters())
    reference = mlp_adamw.reference().cuda()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=ADAMW_LR)
    clip = lambda params: torch.nn.utils.clip_grad_norm_(params, 0.1)  # noqa: E731
    _torch_train_on(reference, optimizer, accumulate, clip)
    for name, parameter in reference.named_parameters():
        torch.testing.assert_close(module.get_parameter(name).detach().cpu(), parameter.detach().cpu(), rtol=0,
                                   atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def _torch_train_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer, accumulate: int, clip: object) -> None:
    """The parity reference loop, with each batch moved to the model's GPU."""

    class OnGpu(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.cuda()).cpu()

    torch_train(OnGpu(), optimizer, accumulate=accumulate, clip=clip)  # type: ignore[arg-type]


def test_gpu_dropout_is_reproducible_under_a_seed(bn_dropout_cnn: Exported) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from tests.strategies import ddp_run

    x, y = ddp_run.dataset("cnn", 32)
    states = []
    for _ in range(2):
        L.seed_everything(5, verbose=False)
        module = ORTLightningModule(bn_dropout_cnn.artifacts, lr=0.01)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        parity_trainer(accelerator="gpu", devices=1, max_steps=4).fit(module, loader)
        states.append({n: t.detach().cpu() for n, t in module.state_dict().items()})
    assert all(torch.equal(states[0][n], states[1][n]) for n in states[0])
