"""Every transport's collectives, the stateless copies around them and the shard layout, tested without a model."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.runtime.param import ShardLayout
from lightning_fsdp.engine.transport import CHUNK_SWITCH, SingleRank, Transport, packing, standalone_transport
from lightning_fsdp.engine.transport.buffers import BufferPool
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.identity import CollectiveMismatchError, Ledger
from lightning_fsdp.engine.transport.nccl import NcclTransport
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport
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


def _transports(group: dist.ProcessGroup) -> dict[str, Transport]:
    """Every transport a CPU group can run: NCCL's data path runs on gloo without side streams (see
    ``transport/nccl.py``), and shared memory with slots of 64 bytes, so every collective below streams in chunks
    whose edges fall inside parameters, inside padding and between ranks' rows (see [Note: chunks] in
    ``transport/shm/slots.py``)."""
    sizes = {"all_gather": 4096, "reduce_scatter": 4096}
    shared, reason = SharedMemoryTransport.create(group, sizes)
    assert shared is not None, f"ranks of one host share memory, but: {reason}"
    os.environ[CHUNK_SWITCH] = "0.00003"  # 31 bytes: one aligned 64-byte slot
    chunked, _ = SharedMemoryTransport.create(group, sizes)
    del os.environ[CHUNK_SWITCH]
    assert chunked is not None and {slots.slot_bytes for slots in chunked.slots.values()} == {64}
    return {
        "gloo": GlooTransport(group),
        "gloo in chunks": GlooInChunks(group),
        "gloo between hosts": GlooTransport(group, between_hosts=True),
        "shared memory": shared,
        "shared memory in chunks": chunked,
        "nccl data path": NcclTransport(group, torch.device("cpu")),
    }


class GlooInChunks(GlooTransport):
    """Gloo with chunks of ~200 bytes: a reduction's few columns of the shapes below per chunk (one at 4 ranks),
    stamps included (see [Note: chunks over gloo] in ``transport/gloo.py``); a gather's messages in pieces of 50
    elements or 100 (see [Note: gathers point to point])."""

    def all_gather_into(self, *args, **kwargs):
        with _chunk_mib("0.0002"):
            return super().all_gather_into(*args, **kwargs)

    def reduce_scatter(self, *args, **kwargs):
        with _chunk_mib("0.0002"):
            return super().reduce_scatter(*args, **kwargs)


@contextlib.contextmanager
def _chunk_mib(value: str) -> Iterator[None]:
    os.environ[CHUNK_SWITCH] = value
    try:
        yield
    finally:
        del os.environ[CHUNK_SWITCH]


def _check_gather_and_reduce(rank: int, world_size: int) -> None:
    group = dist.group.WORLD
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
    sparse_layout = ShardLayout.for_shape(_touched_rows(0).shape, rank, world_size)
    ledger = Ledger(["unit"])
    for label, transport in _transports(group).items():
        for stamp in (None, ledger.stamp("all-gather", 1, "unit")):
            case = f"{label}, {'stamped' if stamp else 'unstamped'}"
            # All-gather then unpack: every rank ends with every full tensor, in fp32 and cast to bf16.
            for dtype in (torch.float32, torch.bfloat16):
                pending = transport.all_gather(shards, dtype, stamp)
                blocks = pending.wait()
                assert [b.numel() for b in blocks] == [sum(lay.shard_numel for lay in layouts)] * world_size, case
                assert {b.dtype for b in blocks} == {dtype}, case
                dests = [torch.full((layout.padded_numel,), -1.0, dtype=dtype) for layout in layouts]
                packing.unpack_all_gather(blocks, [layout.shard_numel for layout in layouts], dests)
                pending.release()
                for full, dest in zip(fulls, dests, strict=True):
                    assert torch.equal(dest[: full.numel()].view(full.shape), full.to(dtype)), case
                # The same straight into the unsharded buffers (what a unit's unshard does).
                dests = [torch.full((layout.padded_numel,), -1.0, dtype=dtype) for layout in layouts]
                with CollectiveCounter() as counter:
                    assert transport.all_gather_into(shards, dtype, stamp, dests).wait() is None, case
                if label in ("shared memory in chunks", "gloo", "gloo in chunks"):
                    # gloo's gather is messages point to point, in pieces in chunks: one all-gather all the same
                    assert [event.kind for event in counter.events] == ["all_gather"], f"announced once, whole: {case}"
                    assert counter.bytes["all_gather"] == sum(s.numel() for s in shards) * dtype.itemsize, case
                for full, dest in zip(fulls, dests, strict=True):
                    assert torch.equal(dest[: full.numel()].view(full.shape), full.to(dtype)), case
            # Reduce-scatter: rank r contributes (r + 1) * full, unpadded (the transport pads); every rank keeps its
            # rows of the sum.
            grads = [
                packing.RankRows(full.reshape(-1) * (rank + 1), layout.shard_numel)
                for full, layout in zip(fulls, layouts, strict=True)
            ]
            grads.append(packing.RankRows(torch.empty(0), 3))  # a gradient that never arrived: zeros
            # Embedding-like gradients, zero but in the rows each rank touched (row 6 by every rank, one row only by
            # this one), and one that never arrived: between hosts they go by rows, elsewhere whole.
            touched = _touched_rows(rank)
            grads.append(packing.RankRows(touched.reshape(-1), sparse_layout.shard_numel, sparse_layout.row_numel))
            grads.append(packing.RankRows(torch.empty(0), 2 * sparse_layout.row_numel, sparse_layout.row_numel))
            summed_rows = sum(_touched_rows(other) for other in range(world_size))
            scale = world_size * (world_size + 1) / 2
            for divide_by in (None, 2):
                reduced = transport.reduce_scatter(grads, torch.float32, stamp, divide_by).wait()
                offset = 0
                for shard, layout in zip(shards, layouts, strict=True):
                    expected = shard * scale / (divide_by or 1)
                    assert torch.equal(reduced[offset : offset + layout.shard_numel], expected), case
                    offset += layout.shard_numel
                assert torch.equal(reduced[offset : offset + 3], torch.zeros(3)), case
                mine = torch.zeros(sparse_layout.chunk_rows, sparse_layout.row_numel)
                mine[: sparse_layout.local_rows] = sparse_layout.local_rows_of(summed_rows) / (divide_by or 1)
                rest = reduced[offset + 3 :]
                assert torch.equal(rest[: mine.numel()], mine.reshape(-1)), f"rows summed: {case}"
                assert torch.equal(rest[mine.numel() :], torch.zeros(2 * sparse_layout.row_numel)), case
            if transport.gathers_rows:  # an embedding's rows as they are looked up: only the wanted rows, exactly
                table = torch.arange(27.0).view(9, 3)
                padded = torch.zeros(world_size * sparse_layout.chunk_rows, 3)
                padded[:9] = table
                shard = padded.view(world_size, -1, 3)[rank]
                full = torch.full_like(padded, float("nan"))
                wanted = torch.zeros(padded.size(0), dtype=torch.uint8)
                wanted[[rank, 8 - rank, 6]] = 1
                received = transport.gather_rows(wanted, shard, full, stamp)
                assert torch.equal(full[wanted.bool()], padded[wanted.bool()]), case
                assert full[~wanted.bool()].isnan().all(), f"only the wanted rows are filled: {case}"
                own = wanted.view(world_size, -1)[rank].sum().item()
                assert received == wanted.sum().item() - own, case
            # All-reduce of packed flat tensors into a tensor of its own.
            flats = [torch.full((5,), float(rank)), torch.full((3,), 1.0)]
            summed = transport.all_reduce(flats, torch.float32, stamp).wait()
            expected = torch.cat([torch.full((5,), scale - world_size), torch.full((3,), float(world_size))])
            assert torch.equal(summed, expected), case
            assert summed.data_ptr() not in {flat.data_ptr() for flat in flats}, case
        transport.end_step()  # the NCCL transport checks its stamps here
        # Ranks in different collectives of equal size: named after the wait, or at the end of the step.
        mismatched = Ledger(["unit", "other"]).stamp("all-gather", 1, "unit" if rank == 0 else "other")
        with pytest.raises(CollectiveMismatchError, match=r"rank \d is in the all-gather #1 of unit '(unit|other)'"):
            transport.all_gather(shards, torch.float32, mismatched).wait()
            transport.end_step()
        with pytest.raises(CollectiveMismatchError, match=r"rank \d is in the all-gather #1 of unit '(unit|other)'"):
            transport.all_reduce([torch.ones(3)], torch.float32, mismatched).wait()
            transport.end_step()
        if isinstance(transport, GlooTransport) and not isinstance(transport, SharedMemoryTransport):
            # Messages point to point: tagged by their collective, they never land in another one's rows.
            dests = [torch.full((layout.padded_numel,), -1.0) for layout in layouts]
            with pytest.raises(CollectiveMismatchError, match=r"is in the all-gather #1 of unit '(unit|other)'"):
                transport.all_gather_into(shards, torch.float32, mismatched, dests).wait()
            assert all(
                torch.equal(
                    dest.view(world_size, -1)[1 - min(rank, 1)], torch.full_like(dest.view(world_size, -1)[0], -1.0)
                )
                for dest in dests
            ), "no peer's rows arrived"
    assert isinstance(standalone_transport(group, torch.device("cpu")), GlooTransport)
    assert isinstance(standalone_transport(None, torch.device("cpu")), SingleRank)


def _touched_rows(rank: int) -> torch.Tensor:
    """A (9, 3) gradient whose rows are zero but row 6 and row ``rank`` (a 4-rank group pads it to 12 rows)."""
    grad = torch.zeros(9, 3)
    grad[6] = torch.tensor([1.0, -2.0, 0.5])
    grad[rank] += rank + 1.0
    return grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_row_is_touched_when_any_of_its_bits_is_set(dtype: torch.dtype) -> None:
    """Rows of zeros are the only untouched ones: a denormal, a NaN, an infinity or a lone -0.0 marks its row (sending
    a row of -0.0 adds nothing), whatever the dtype's width."""
    rows = torch.zeros(7, 5, dtype=dtype)
    rows[1, 4] = torch.finfo(dtype).tiny / 2  # below the smallest normal number
    rows[2, 0] = float("nan")
    rows[3, 2] = float("-inf")
    rows[4, 3] = -0.0
    rows[6] = 1.5
    assert packing.nonzero_rows(rows).tolist() == [False, True, True, True, True, False, True]
    assert packing.nonzero_rows(rows[:, 1:]).tolist() == [False, True, False, True, True, False, True]  # strided


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_unpack_and_reduce_scatter_round_trip(world_size: int) -> None:
    run_distributed(_check_gather_and_reduce, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_pack_rows_pads_in_place_of_a_padded_copy(world_size: int) -> None:
    """Every shape of SHAPES, and a gradient that never arrived (empty: zeros), packed side by side into a
    (world_size, columns) buffer full of garbage: equal to the zero-padded views packed by concatenation, in fp32 and
    cast to bf16 (mixed precision's reduce dtype)."""
    fulls = [_full(i, world_size) for i in range(len(SHAPES))]
    layouts = [ShardLayout.for_shape(full.shape, 0, world_size) for full in fulls]
    flats = [full.reshape(-1) for full in fulls] + [torch.empty(0)]
    columns = [layout.shard_numel for layout in layouts] + [layouts[0].shard_numel]
    padded = []
    for flat, width in zip(flats, columns, strict=True):
        view = torch.zeros(world_size * width)
        view[: flat.numel()] = flat
        padded.append(view.view(world_size, width))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((world_size, sum(columns) + 2), float("nan"), dtype=dtype)[:, 1:-1]  # a strided slot
        packing.pack_rows([packing.RankRows(flat, width) for flat, width in zip(flats, columns, strict=True)], out)
        assert torch.equal(out, torch.cat(padded, dim=-1).to(dtype)), dtype
        for start, width in ((0, 1), (1, 5), (5, 9), (sum(columns) - 3, 3)):  # chunks: edges anywhere
            chunk = torch.full((world_size, width), float("nan"), dtype=dtype)
            grads = [packing.RankRows(flat, cols) for flat, cols in zip(flats, columns, strict=True)]
            packing.pack_rows(grads, chunk, start)
            assert torch.equal(chunk, out[:, start : start + width]), (dtype, start, width)
        unpadded = [packing.RankRows(torch.arange(world_size * 3.0), 3), packing.RankRows(torch.ones(0), 0)]
        fused = torch.empty(world_size, 3, dtype=dtype)
        packing.pack_rows(unpadded, fused)  # nothing to pad: the one fused copy
        assert torch.equal(fused, torch.arange(world_size * 3.0).view(world_size, 3).to(dtype)), dtype


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


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_own_row_summed_from_the_gradients_equals_the_packed_sum(world_size: int, dtype: torch.dtype) -> None:
    """Every rank's buffer from ``pack_peer_rows`` (its own row never written: left NaN here) and each rank's row
    summed by ``sum_own_row`` from the others' buffers and its own gradients: bit for bit the zero-padded rows summed
    then divided, for every shape of SHAPES, a gradient that never arrived (empty) and a rank with no rows (3 rows
    on 4 or 5 ranks), with a power-of-two divisor folded in and without one."""
    fulls = [_full(i, world_size) for i in range(len(SHAPES))]
    columns = [ShardLayout.for_shape(full.shape, 0, world_size).shard_numel for full in fulls] + [2]
    flats_by_rank = [[full.reshape(-1) * (rank + 1) for full in fulls] + [torch.empty(0)] for rank in range(world_size)]
    grads_by_rank = [
        [packing.RankRows(flat.to(dtype), width) for flat, width in zip(flats, columns, strict=True)]
        for flats in flats_by_rank
    ]
    padded_by_rank = []
    for grads in grads_by_rank:
        padded = torch.empty(world_size, sum(columns), dtype=dtype)
        packing.pack_rows(grads, padded)
        padded_by_rank.append(padded)
    for divisor in (1, 2, 4):
        scale = 1.0 / divisor
        buffers = []
        for rank, grads in enumerate(grads_by_rank):
            buffer = torch.full((world_size, sum(columns) + 2), float("nan"), dtype=dtype)[:, 1:-1]  # strided
            packing.pack_peer_rows(grads, buffer, rank, scale)
            assert torch.isnan(buffer[rank]).all(), "the own row is never packed"
            buffers.append(buffer)
        for rank, grads in enumerate(grads_by_rank):
            peers = [buffer[rank] for other, buffer in enumerate(buffers) if other != rank]
            out = torch.full((sum(columns),), float("nan"), dtype=dtype)
            packing.sum_own_row(grads, rank, peers, scale, out)
            expected = packing.sum_rows([padded[rank] for padded in padded_by_rank]).div_(divisor)
            assert torch.equal(out, expected), (rank, divisor)
            for start, width in ((0, 1), (1, 5), (5, 9), (sum(columns) - 3, 3)):  # a chunk of columns at a time
                chunks = []
                for other, grads in enumerate(grads_by_rank):
                    chunk = torch.full((world_size, width), float("nan"), dtype=dtype)
                    packing.pack_peer_rows(grads, chunk, other, scale, start)
                    assert torch.equal(chunk[rank], buffers[other][rank, start : start + width]) or other == rank
                    chunks.append(chunk)
                peers = [chunk[rank] for other, chunk in enumerate(chunks) if other != rank]
                part = torch.full((width,), float("nan"), dtype=dtype)
                packing.sum_own_row(grads_by_rank[rank], rank, peers, scale, part, start)
                assert torch.equal(part, expected[start : start + width]), (rank, divisor, start)
