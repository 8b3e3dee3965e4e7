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

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


@dataclass
class PendingAllGather:
    """An all-gather in flight: ``output`` holds every rank's packed shards, rank-major, once ``work`` is done."""

    output: torch.Tensor
    work: dist.Work | None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output


def all_gather_shards(
    shards: list[torch.Tensor], group: ProcessGroup | None, world_size: int, dtype: torch.dtype | None = None
) -> PendingAllGather:
    """Pack this rank's (padded) shards into one buffer, cast to ``dtype``, and all-gather it asynchronously."""
    send = torch.cat([shard.reshape(-1) for shard in shards])
    if dtype is not None and send.dtype != dtype:
        send = send.to(dtype)
    output = send.new_empty(world_size * send.numel())
    if world_size == 1:
        output.copy_(send)
        return PendingAllGather(output, None)
    work = _all_gather_flat(output, send, group=group, async_op=True)
    return PendingAllGather(output, work)


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


def pack_for_reduce_scatter(grads_by_rank: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (world_size, shard_numel_i) gradient views into one (world_size, shard_sum) send buffer."""
    return torch.cat(grads_by_rank, dim=1)


@dataclass
class PendingReduceScatter:
    """A reduce-scatter in flight; ``wait`` returns this rank's summed shard of the flat buffer."""

    buffer: torch.Tensor
    work: dist.Work | None
    needs_local_sum: bool

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.needs_local_sum:
            self.buffer = self.buffer.sum(dim=0)
            self.needs_local_sum = False
        return self.buffer


def reduce_scatter(send: torch.Tensor, group: ProcessGroup | None, world_size: int) -> PendingReduceScatter:
    """Sum a (world_size, shard_sum) buffer over ranks and keep row ``rank`` of the sum, asynchronously."""
    if world_size == 1 or group is None:
        return PendingReduceScatter(send.view(-1), None, needs_local_sum=False)
    if _is_gloo(group):  # see [Note: reduce-scatter on gloo]
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
        return PendingReduceScatter(received, work, needs_local_sum=True)
    output = send.new_empty(send.size(1))
    work = _reduce_scatter_flat(output, send.view(-1), group=group, async_op=True)
    return PendingReduceScatter(output, work, needs_local_sum=False)


def all_reduce(flat: torch.Tensor, group: ProcessGroup, world_size: int) -> PendingReduceScatter:
    """Sum a flat buffer over ranks in place, asynchronously (NO_SHARD's one collective per unit)."""
    if world_size == 1:
        return PendingReduceScatter(flat, None, needs_local_sum=False)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return PendingReduceScatter(flat, work, needs_local_sum=False)
