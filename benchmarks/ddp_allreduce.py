"""Time of one gradient all-reduce round relative to one ORT train step, on 2 gloo ranks.

Run: ``python -m benchmarks.ddp_allreduce [--steps 30] [--batch 64] [--world 2]``. A ~1M-parameter
MLP is exported once; each rank times ORT's forward+backward+update, then the coalesced
all-reduce of its gradient views (what ORTDDPStrategy runs once per optimizer step), and, for
comparison, one all-reduce per gradient tensor. Rank 0 prints the times and their ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ort_lightning import ORTLightningModule, export_artifacts
from ort_lightning.strategies.buckets import CoalescedTensors


def _model() -> torch.nn.Module:
    # 512*1024 + 1024*512 + 512*10 weights and their biases: about 1.05M parameters.
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def _per_call_ms(function: Callable[[], None], steps: int) -> float:
    for _ in range(3):
        function()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        function()
    return (time.perf_counter() - start) / steps * 1e3


def _worker(rank: int, world: int, port: int, artifacts: str, steps: int, batch: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    module = ORTLightningModule(artifacts, lr=1e-3)
    session, inputs = module.ort_session, module.live_session.views.train_inputs
    x, y = torch.randn(batch, 512), torch.randint(0, 10, (batch,))
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    coalesced = CoalescedTensors(grads)

    def train_step() -> None:
        session.train_step(inputs((x, y)))
        session.optimizer_step()
        session.lazy_reset_grad()

    def per_tensor() -> None:
        for grad in grads:
            dist.all_reduce(grad)

    train_ms = _per_call_ms(train_step, steps)
    reduce_ms = _per_call_ms(coalesced.all_reduce_mean, steps)
    per_tensor_ms = _per_call_ms(per_tensor, steps)
    if rank == 0:
        count = sum(g.numel() for g in grads)
        print(f"parameters: {count:,} in {len(grads)} tensors, {len(coalesced.buckets)} bucket(s); "
              f"world {world}, batch {batch} per rank, {steps} steps")
        print(f"train step (ORT forward+backward+AdamW): {train_ms:8.2f} ms")
        print(f"coalesced all-reduce round:              {reduce_ms:8.2f} ms  "
              f"({reduce_ms / train_ms:.2f} x train step)")
        print(f"one all-reduce per tensor:               {per_tensor_ms:8.2f} ms  "
              f"({per_tensor_ms / train_ms:.2f} x train step)")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        export_artifacts(_model(), torch.zeros(2, 512), directory)
        mp.spawn(_worker, args=(args.world, _free_port(), directory, args.steps, args.batch), nprocs=args.world)


if __name__ == "__main__":
    main()
