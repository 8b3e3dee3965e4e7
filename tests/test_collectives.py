"""The stateless collectives and the shard layout, tested without a model."""

from __future__ import annotations

import pytest
import torch

from lightning_fsdp.engine import collectives
from lightning_fsdp.engine.buffers import BufferPool
from lightning_fsdp.engine.param import ShardLayout
from lightning_fsdp.engine.shm import SharedMemoryTransport
from tests.distributed import run_distributed

# (rows, row shape): divisible, not divisible, fewer rows than ranks, a 0-dim tensor.
SHAPES = [(8, (3,)), (7, (2, 2)), (3, ()), (None, ())]


def _full(index: int, world_size: int) -> torch.Tensor:
    rows, rest = SHAPES[index]
    shape = () if rows is None else (rows, *rest)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 100 * index


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8])
def test_layout_gives_every_row_to_exactly_one_rank(world_size: int, rows: int) -> None:
    layouts = [ShardLayout.for_shape(torch.Size((rows, 2)), rank, world_size) for rank in range(world_size)]
    owned = [row for layout in layouts for row in range(layout.start, layout.start + layout.local_rows)]
    assert owned == list(range(rows))
    assert {layout.shard_numel for layout in layouts} == {-(-rows // world_size) * 2}, "equal-sized shards"


def _check_gather_and_reduce(rank: int, world_size: int) -> None:
    group = torch.distributed.group.WORLD
    fulls = [_full(i, world_size) for i in range(len(SHAPES))]
    layouts = [ShardLayout.for_shape(full.shape, rank, world_size) for full in fulls]
    shards = []
    for full, layout in zip(fulls, layouts, strict=True):
        padded = torch.zeros(layout.shard_numel)
        local = full.reshape(-1)[
            layout.start * layout.row_numel : (layout.start + layout.local_rows) * layout.row_numel
        ]
        padded[: local.numel()] = local
        shards.append(padded)
    needed = world_size * sum(layout.shard_numel for layout in layouts) * 4
    shared_memory = SharedMemoryTransport.create(group, needed)
    assert shared_memory is not None, "ranks of one host share memory"
    for transport in (None, shared_memory):
        label = "gloo" if transport is None else "shared memory"
        # All-gather then unpack: every rank ends with every full tensor.
        pool = BufferPool()
        pending = collectives.all_gather_shards(shards, group, world_size, torch.float32, pool, transport)
        blocks = pending.wait()
        assert [block.numel() for block in blocks] == [sum(layout.shard_numel for layout in layouts)] * world_size
        dests = [torch.full((layout.padded_numel,), -1.0) for layout in layouts]
        collectives.unpack_all_gather(blocks, [layout.shard_numel for layout in layouts], dests)
        pending.release()
        for full, dest in zip(fulls, dests, strict=True):
            assert torch.equal(dest[: full.numel()].view(full.shape), full), label
        # Reduce-scatter: rank r contributes (r + 1) * full; every rank keeps its rows of the sum.
        by_rank = []
        for full, layout in zip(fulls, layouts, strict=True):
            padded = torch.zeros(layout.padded_numel)
            padded[: full.numel()] = full.reshape(-1) * (rank + 1)
            by_rank.append(padded.view(world_size, layout.shard_numel))
        columns = sum(view.size(1) for view in by_rank)
        send, slot = collectives.reduce_scatter_send_buffer(
            world_size, columns, torch.float32, torch.device("cpu"), pool, transport
        )
        assert (slot is not None) == (transport is not None), label
        torch.cat(by_rank, dim=1, out=send)
        shared = (transport, slot) if transport is not None and slot is not None else None
        reduced = collectives.reduce_scatter(send, group, world_size, pool, shared).wait()
        scale = world_size * (world_size + 1) / 2
        offset = 0
        for shard, layout in zip(shards, layouts, strict=True):
            assert torch.equal(reduced[offset : offset + layout.shard_numel], shard * scale), label
            offset += layout.shard_numel
    # All-reduce, in place.
    scale = world_size * (world_size + 1) / 2
    flat = torch.full((5,), float(rank))
    assert torch.equal(collectives.all_reduce(flat, group, world_size).wait(), torch.full((5,), scale - world_size))


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_unpack_and_reduce_scatter_round_trip(world_size: int) -> None:
    run_distributed(_check_gather_and_reduce, world_size)


def test_pool_reuses_buffers_by_size_and_keeps_few() -> None:
    pool = BufferPool()
    first = pool.take(10, torch.float32, torch.device("cpu"))
    pool.give(first)
    assert pool.take(10, torch.float32, torch.device("cpu")).data_ptr() == first.data_ptr(), "a freed buffer is reused"
    assert pool.take(10, torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr(), "a taken one is not"
    given = [torch.empty(7) for _ in range(5)]
    for tensor in given:
        pool.give(tensor)
    taken = {pool.take(7, torch.float32, torch.device("cpu")).data_ptr() for _ in range(3)}
    assert len(taken & {t.data_ptr() for t in given}) == 2, "at most two buffers of one size are kept"
    nothing_kept = BufferPool(retain=False)
    nothing_kept.give(first)
    assert nothing_kept.take(10, torch.float32, torch.device("cpu")).data_ptr() != first.data_ptr()
