"""Stateless collectives over one unit's flat buffers: pack, all-gather, unpack; pack, reduce-scatter, all-reduce.

Every function issues at most ONE collective for a whole unit, with equal-sized inputs on every rank, and returns
a pending handle so that callers overlap communication with compute and wait only where the result is needed.

[Note: reduce-scatter on gloo] gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input plus
copies, moving twice the bytes a reduce-scatter needs. An ``all_to_all_single`` that sends rank r the r-th slice
of every rank's input, followed by a local sum, moves exactly the reduce-scatter minimum ((W - 1)/W of the
input per rank) and runs asynchronously on gloo's worker threads, so on gloo we build the reduce-scatter that way.
Backends with a real reduce-scatter (NCCL) use it directly. Between CPU ranks of one host, the data of both
collectives goes through shared memory instead when a transport is given (see ``shm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine import shm
from lightning_fsdp.engine.buffers import BufferPool
from lightning_fsdp.engine.ledger import Stamp

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


@dataclass
class PendingAllGather:
    """An all-gather over gloo in flight: ``output`` holds every rank's packed shards, rank-major, once it is done.

    ``send`` is kept alive until then: the collective reads it asynchronously.
    """

    output: torch.Tensor
    work: dist.Work | None
    send: torch.Tensor
    world_size: int
    pool: BufferPool

    def wait(self) -> torch.Tensor:
        """Every rank's packed shards, as (world_size, shard_sum): row r is rank r's."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output.view(self.world_size, -1)

    def release(self) -> None:
        """The caller has copied what it needs out of the views ``wait`` returned."""
        self.wait()
        self.pool.give(self.send)
        self.pool.give(self.output)


def all_gather_shards(
    shards: list[torch.Tensor],
    group: ProcessGroup | None,
    world_size: int,
    dtype: torch.dtype,
    pool: BufferPool,
    transport: shm.SharedMemoryTransport | None = None,
    stamp: Stamp | None = None,
) -> PendingAllGather | shm.PendingSharedGather:
    """Pack this rank's (padded) shards into one ``dtype`` buffer and all-gather it asynchronously.

    The buffer is a slot of the shared-memory transport when there is one with a free slot (see [Note: why shared
    memory on CPU] in ``shm.py``), else a pooled buffer all-gathered over the group's backend. ``stamp``: the
    collective's identity, checked on every rank before its data is used (see [Note: collective identity]).
    """
    numel = sum(shard.numel() for shard in shards)
    shared = shm.send_buffer(transport, numel, dtype) if world_size > 1 else None
    send = shared[0] if shared is not None else pool.take(numel, dtype, shards[0].device)
    if all(shard.dtype == dtype for shard in shards):
        torch.cat([shard.reshape(-1) for shard in shards], out=send)
    else:  # mixed precision: the cast is the packing copy
        torch._foreach_copy_(list(send.split([shard.numel() for shard in shards])), [s.reshape(-1) for s in shards])
    if shared is not None:
        assert transport is not None
        return shm.all_gather(transport, shared[1], send, stamp)
    output = pool.take(world_size * numel, dtype, send.device)
    if world_size == 1:
        output.copy_(send)
        return PendingAllGather(output, None, send, world_size, pool)
    if stamp is not None:
        stamp.exchange(group)
    work = _all_gather_flat(output, send, group=group, async_op=True)
    return PendingAllGather(output, work, send, world_size, pool)


def unpack_all_gather(
    gathered: torch.Tensor | list[torch.Tensor], shard_numels: list[int], dests: list[torch.Tensor]
) -> None:
    """Copy each parameter's rows out of every rank's packed shards into its padded unsharded buffer.

    Row r of ``gathered`` (a (world_size, shard_sum) tensor, or one 1-D block per rank when the blocks lie in
    separate shared-memory segments) is the concatenation of every parameter's shard on rank r; the rows of
    parameter i from rank r belong at row r of its padded full tensor viewed as (world_size, shard_numel_i). One
    fused op does the copies of all ranks (of each rank, for separate blocks).
    """
    world_size = len(gathered)
    rows = [dest.view(world_size, -1) for dest in dests]
    if isinstance(gathered, torch.Tensor):
        torch.split_with_sizes_copy(gathered, shard_numels, dim=1, out=rows)
        return
    for rank, block in enumerate(gathered):
        torch.split_with_sizes_copy(block.view(1, -1), shard_numels, dim=1, out=[row[rank : rank + 1] for row in rows])


def reduce_scatter_send_buffer(
    rows: int,
    columns: int,
    dtype: torch.dtype,
    device: torch.device,
    pool: BufferPool,
    transport: shm.SharedMemoryTransport | None = None,
) -> tuple[torch.Tensor, int | None]:
    """The (rows, columns) buffer a reduction sends: a shared-memory slot (with its number) if one is free."""
    shared = shm.send_buffer(transport, rows * columns, dtype) if rows > 1 else None
    if shared is not None:
        return shared[0].view(rows, columns), shared[1]
    return pool.take(rows * columns, dtype, device).view(rows, columns), None


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
            self.buffer = shm.sum_rows(list(self.buffer.unbind(0)))
            self.needs_local_sum = False
        if self.pool is not None:
            for tensor in self.recycle:
                self.pool.give(tensor)
            self.pool, self.recycle = None, ()
        return self.buffer


def reduce_scatter(
    send: torch.Tensor,
    group: ProcessGroup | None,
    world_size: int,
    pool: BufferPool,
    shared: tuple[shm.SharedMemoryTransport, int] | None = None,
    stamp: Stamp | None = None,
) -> PendingReduceScatter | shm.PendingSharedReduceScatter:
    """Sum a (world_size, shard_sum) buffer over ranks and keep row ``rank`` of the sum, asynchronously.

    ``shared``: the transport and slot ``send`` was written into (``reduce_scatter_send_buffer``). The result never
    aliases a pooled or shared buffer: it becomes the parameters' ``.grad``.
    """
    if shared is not None:
        return shm.reduce_scatter(shared[0], shared[1], send, stamp)
    if world_size == 1 or group is None:
        return PendingReduceScatter(send.view(-1).clone(), None, False, pool, (send,))
    if stamp is not None:
        stamp.exchange(group)
    if _is_gloo(group):  # see [Note: reduce-scatter on gloo]
        received = pool.take(send.numel(), send.dtype, send.device).view_as(send)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
        return PendingReduceScatter(received, work, True, pool, (send, received))
    output = send.new_empty(send.size(1))
    work = _reduce_scatter_flat(output, send.view(-1), group=group, async_op=True)
    return PendingReduceScatter(output, work, False, pool, (send,))


def all_reduce(
    flat: torch.Tensor, group: ProcessGroup | None, world_size: int, stamp: Stamp | None = None
) -> PendingReduceScatter:
    """Sum a flat buffer over ranks in place, asynchronously (NO_SHARD's one collective per unit)."""
    if world_size == 1 or group is None:
        return PendingReduceScatter(flat, None, needs_local_sum=False)
    if stamp is not None:
        stamp.exchange(group)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return PendingReduceScatter(flat, work, needs_local_sum=False)
