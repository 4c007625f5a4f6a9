"""Coalesced collectives over many tensors that live apart (ORT's parameter and gradient buffers).

One collective per tensor costs a round trip each; torch's DistributedDataParallel instead
packs gradients into buckets of about 25 MB. `CoalescedTensors` does the same for tensors it
cannot move (views of memory ONNX Runtime owns): it copies them into a few flat buffers, one
per (device, dtype) and size cap, starts every collective asynchronously, then copies the
results back in place, so that ORT reads them without knowing torch.distributed exists.

Example::

    >>> import torch
    >>> tensors = [torch.ones(2, 3), torch.zeros(4), torch.ones(1, dtype=torch.int64)]
    >>> coalesced = CoalescedTensors(tensors)
    >>> [(bucket.flat.dtype, bucket.flat.numel()) for bucket in coalesced.buckets]
    [(torch.float32, 10), (torch.int64, 1)]
    >>> coalesced.all_reduce_mean()  # without a process group: nothing to reduce
    >>> tensors[0].sum().item()
    6.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "CoalescedTensors"]

#: torch DDP's default ``bucket_cap_mb`` (25 MB).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(frozen=True)
class Bucket:
    """Tensors of one device and dtype, and the flat buffer that carries them in one collective."""

    tensors: tuple[torch.Tensor, ...]
    flat: torch.Tensor
    slices: tuple[torch.Tensor, ...]  # views of `flat`, shaped like `tensors`

    def pack(self) -> None:
        """Copy the tensors into the flat buffer."""
        torch._foreach_copy_(self.slices, self.tensors)

    def unpack(self) -> None:
        """Copy the flat buffer back into the tensors, in place."""
        torch._foreach_copy_(self.tensors, self.slices)


def _bucket(tensors: Sequence[torch.Tensor]) -> Bucket:
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    slices, offset = [], 0
    for tensor in tensors:
        slices.append(flat[offset : offset + tensor.numel()].view(tensor.shape))
        offset += tensor.numel()
    return Bucket(tuple(tensors), flat, tuple(slices))


def plan_buckets(tensors: Sequence[torch.Tensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Group `tensors` by (device, dtype) in their order, closing a bucket once it reaches `bucket_bytes`."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for tensor in tensors:
        key = (tensor.device, tensor.dtype)
        open_buckets = groups.setdefault(key, [[]])
        if open_buckets[-1] and sizes[key] >= bucket_bytes:
            open_buckets.append([])
            sizes[key] = 0
        open_buckets[-1].append(tensor)
        sizes[key] = sizes.get(key, 0) + tensor.numel() * tensor.element_size()
    return [_bucket(members) for buckets in groups.values() for members in buckets]


class CoalescedTensors:
    """A fixed list of tensors averaged or broadcast in place across the ranks of a process group.

    Args:
        tensors: the tensors (any devices and dtypes; they stay where they are).
        bucket_bytes: the size at which a flat buffer is closed and the next one begins.
        group: the process group; None is the default (world) group.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"Expected argument `bucket_bytes` to be a positive int, but got {bucket_bytes!r}.")
        self.buckets = plan_buckets(tensors, bucket_bytes=bucket_bytes)
        self.group = group
        self._cuda = any(bucket.flat.is_cuda for bucket in self.buckets)

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    @torch.no_grad()
    def all_reduce_mean(self) -> None:
        """Replace every tensor by its mean over the ranks (a no-op in a single process)."""
        world = self._world_size()
        if world == 1:
            return
        pending = []
        for bucket in self.buckets:
            bucket.pack()
            # NOTE: gloo has no AVG reduction; SUM then one division per bucket works everywhere.
            work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            pending.append((bucket, work))
        for bucket, work in pending:
            work.wait()
            if bucket.flat.is_floating_point():
                bucket.flat.div_(world)
            else:
                bucket.flat.floor_divide_(world)
            bucket.unpack()
        self._hand_over()

    @torch.no_grad()
    def broadcast(self, src: int = 0) -> None:
        """Overwrite every tensor with rank `src`'s values (a no-op in a single process)."""
        if self._world_size() == 1:
            return
        pending = []
        for bucket in self.buckets:
            bucket.pack()
            pending.append((bucket, dist.broadcast(bucket.flat, src=src, group=self.group, async_op=True)))
        for bucket, work in pending:
            work.wait()
            bucket.unpack()
        self._hand_over()

    def _hand_over(self) -> None:
        if self._cuda:
            # NOTE: ORT reads these buffers on its own CUDA stream, which does not wait for torch's.
            torch.cuda.synchronize()
