"""Stateless collectives over one unit's flat buffers: pack, all-gather, unpack; pack, reduce-scatter, all-reduce.

Every function issues at most ONE collective for a whole unit, with equal-sized inputs on every rank, and returns
a pending handle so that callers overlap communication with compute and wait only where the result is needed.

[Note: reduce-scatter on gloo] gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input plus
copies, moving twice the bytes a reduce-scatter needs. An ``all_to_all_single`` that sends rank r the r-th slice
of every rank's input, followed by a local sum, moves exactly the reduce-scatter minimum ((W - 1)/W of the
input per rank) and runs asynchronously on gloo's worker threads, so on gloo we build the reduce-scatter that way.
Backends with a real reduce-scatter (NCCL) use it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.buffers import BufferPool

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


@dataclass
class PendingAllGather:
    """An all-gather in flight: ``output`` holds every rank's packed shards, rank-major, once ``work`` is done.

    ``send`` is kept alive until then: the collective reads it asynchronously.
    """

    output: torch.Tensor
    work: dist.Work | None
    send: torch.Tensor

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output


def all_gather_shards(
    shards: list[torch.Tensor], group: ProcessGroup | None, world_size: int, dtype: torch.dtype, pool: BufferPool
) -> PendingAllGather:
    """Pack this rank's (padded) shards into one ``dtype`` buffer and all-gather it asynchronously."""
    numel = sum(shard.numel() for shard in shards)
    device = shards[0].device
    send = pool.take(numel, dtype, device)
    if all(shard.dtype == dtype for shard in shards):
        torch.cat([shard.reshape(-1) for shard in shards], out=send)
    else:  # mixed precision: the cast is the packing copy
        torch._foreach_copy_(list(send.split([shard.numel() for shard in shards])), [s.reshape(-1) for s in shards])
    output = pool.take(world_size * numel, dtype, device)
    if world_size == 1:
        output.copy_(send)
        return PendingAllGather(output, None, send)
    work = _all_gather_flat(output, send, group=group, async_op=True)
    return PendingAllGather(output, work, send)


def unpack_all_gather(
    output: torch.Tensor, world_size: int, shard_numels: list[int], dests: list[torch.Tensor]
) -> None:
    """Copy each parameter's rows out of the rank-major gather output into its padded unsharded buffer.

    The output is ``world_size`` blocks, each the concatenation of every parameter's shard on that rank; viewed as
    (world_size, shard_sum) the column range of parameter i holds its rows in rank order, which is exactly the
    layout of its padded full tensor viewed as (world_size, shard_numel_i). One fused op does all the copies.
    """
    torch.split_with_sizes_copy(
        output.view(world_size, -1), shard_numels, dim=1, out=[dest.view(world_size, -1) for dest in dests]
    )


def pack_for_reduce_scatter(grads_by_rank: list[torch.Tensor], pool: BufferPool) -> torch.Tensor:
    """Concatenate (world_size, shard_numel_i) gradient views into one (world_size, shard_sum) send buffer."""
    rows, columns = grads_by_rank[0].size(0), sum(g.size(1) for g in grads_by_rank)
    send = pool.take(rows * columns, grads_by_rank[0].dtype, grads_by_rank[0].device).view(rows, columns)
    return torch.cat(grads_by_rank, dim=1, out=send)


@dataclass
class PendingReduceScatter:
    """A reduce-scatter in flight; ``wait`` returns this rank's summed shard of the flat buffer.

    ``recycle`` lists the pooled buffers the collective uses, handed back to ``pool`` once it is done.
    """

    buffer: torch.Tensor
    work: dist.Work | None
    needs_local_sum: bool
    pool: BufferPool | None = None
    recycle: tuple[torch.Tensor, ...] = ()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.needs_local_sum:
            self.buffer = self.buffer.sum(dim=0)
            self.needs_local_sum = False
        if self.pool is not None:
            for tensor in self.recycle:
                self.pool.give(tensor)
            self.pool, self.recycle = None, ()
        return self.buffer


def reduce_scatter(
    send: torch.Tensor, group: ProcessGroup | None, world_size: int, pool: BufferPool
) -> PendingReduceScatter:
    """Sum a (world_size, shard_sum) buffer over ranks and keep row ``rank`` of the sum, asynchronously.

    The result never aliases a pooled buffer: it becomes the parameters' ``.grad``.
    """
    if world_size == 1 or group is None:
        return PendingReduceScatter(send.view(-1).clone(), None, False, pool, (send,))
    if _is_gloo(group):  # see [Note: reduce-scatter on gloo]
        received = pool.take(send.numel(), send.dtype, send.device).view_as(send)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
        return PendingReduceScatter(received, work, True, pool, (send, received))
    output = send.new_empty(send.size(1))
    work = _reduce_scatter_flat(output, send.view(-1), group=group, async_op=True)
    return PendingReduceScatter(output, work, False, pool, (send,))


def all_reduce(flat: torch.Tensor, group: ProcessGroup | None, world_size: int) -> PendingReduceScatter:
    """Sum a flat buffer over ranks in place, asynchronously (NO_SHARD's one collective per unit)."""
    if world_size == 1 or group is None:
        return PendingReduceScatter(flat, None, needs_local_sum=False)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return PendingReduceScatter(flat, work, needs_local_sum=False)
