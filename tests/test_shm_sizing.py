"""Shared-memory slots sized per collective: all-gathers need one shard, reduce-scatters ``world_size`` shards.

2 and 4 gloo ranks: the transport's layout and slot choice, then a FULL_SHARD model whose transport the engine sized
from its units (the largest shard for the gather slots, the largest gradient for the others) and whose collectives
still all go through shared memory, trained against its unsharded self.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.comm_stats import CollectiveCounter
from lightning_fsdp.engine.registry import units_under
from lightning_fsdp.engine.shm import GATHER_SLOTS, SLOTS, SharedMemoryTransport
from lightning_fsdp.engine.state_dict import full_state_dict
from tests.distributed import run_distributed


def _check_layout(rank: int, world_size: int) -> None:
    transport = SharedMemoryTransport.create(dist.group.WORLD, 1000, gather_bytes=300)
    assert transport is not None
    assert transport.slot_sizes == [320] * GATHER_SLOTS + [1024] * (SLOTS - GATHER_SLOTS)  # 64-byte aligned
    assert transport.resident_bytes == 2 * 320 + 2 * 1024
    assert transport.acquire(500) == 2, "a reduce-scatter skips the gather slots it does not fit"
    assert transport.acquire(100) == 0, "a gather takes the gather slot free the longest"
    assert transport.acquire(100) == 1
    assert transport.acquire(100) == 3, "with the gather slots taken, a gather fits a large slot"
    assert transport.acquire(8) is None, "every slot in flight: gloo"
    transport.release(3)
    assert transport.acquire(1025) is None, "larger than any slot: gloo"
    for slot in (0, 1, 2):
        transport.release(slot)
    assert transport.acquire(600) == 3, "the first large slot in release order"
    transport.release(3)


def _check_model(rank: int, world_size: int) -> None:
    config = GPTConfig(vocab_size=61, block_size=8, n_layer=3, n_head=2, n_embd=16)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2 * world_size, config.block_size + 1), generator=generator)
    mine = tokens[2 * rank : 2 * rank + 2]  # each rank its own slice; the reference takes the whole batch
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = CollectiveCounter()
    for step in range(2):
        with comm if step == 1 else nullcontext():  # the second step: the first also checks the model across ranks
            model(mine[:, :-1], mine[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    for _ in range(2):
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    units = [u for u in units_under(model) if u.params]
    transport = units[0].transport()
    assert transport is not None
    gather, largest = max(u.gather_bytes() for u in units), max(u.collective_bytes() for u in units)
    assert transport.slot_sizes[:GATHER_SLOTS] == [-(-gather // 64) * 64] * GATHER_SLOTS
    assert transport.slot_sizes[GATHER_SLOTS:] == [-(-largest // 64) * 64] * (SLOTS - GATHER_SLOTS)
    assert gather * world_size == largest, "a gather slot holds one shard, a gradient slot world_size of them"
    moved = [e for e in comm.events if e.kind in ("all_gather", "reduce_scatter")]
    assert {e.kind for e in moved} == {"all_gather", "reduce_scatter"}
    assert all(e.op.startswith("shm::") for e in moved), {e.op for e in moved}
    ours = full_state_dict(model, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 4])
def test_slots_are_sized_per_collective(world_size: int) -> None:
    run_distributed(_check_layout, world_size)
    run_distributed(_check_model, world_size)
