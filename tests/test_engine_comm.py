"""Counted communication: one flat collective per unit per transition, with exactly the padded shard bytes."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.transport import shm
from lightning_fsdp.engine.transport.identity import DIGEST_BITS, STAMP_BYTES
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, data_moving, initialize, reduce_scatter_kind

FP32 = 4
# Bytes a gloo collective sends beyond its data (see [Note: stamps in the frames] in
# lightning_fsdp/engine/transport/gloo.py):
# a stamp per frame; a summing collective carries digest bits in the data's dtype instead.
FRAME_OVERHEAD = {
    "all_gather": lambda world_size: 0,  # messages point to point, their tag the identity (see [Note: gathers ...])
    "all_to_all": lambda world_size: world_size * STAMP_BYTES,
    "all_reduce": lambda world_size: DIGEST_BITS * FP32,
}


def _unit_shard_numels(model: GPT, world_size: int) -> list[int]:
    """Per unit (blocks in order, then the root), the padded elements one rank packs: sum of ceil(rows/W) rows.

    Over gloo alone the reduce-scatter is an all-to-all of the (W, shard_sum) gradient buffer plus a local sum
    (see [Note: reduce-scatter on gloo] in ``transport/gloo.py``), so it is counted as "all_to_all"; through shared
    memory it is counted as the reduce-scatter it is, with the same send buffer.
    """

    def shard_numel(param: torch.Tensor) -> int:
        rows = param.shape[0] if param.dim() else 1
        return math.ceil(rows / world_size) * (param.numel() // rows if param.dim() else 1)

    block_ids = {id(p) for block in model.blocks for p in block.parameters()}
    per_block = [sum(shard_numel(p) for p in block.parameters()) for block in model.blocks]
    root = sum(shard_numel(p) for p in model.parameters() if id(p) not in block_ids)  # the tied weight once
    return [*per_block, root]


def _count_one_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> CollectiveCounter:
    with CollectiveCounter() as counter:
        model(*batch).backward()
    return counter


def _check_counts(rank: int, world_size: int, shared_memory: bool) -> None:
    os.environ[shm.ENV_SWITCH] = "1" if shared_memory else "0"
    reduce = reduce_scatter_kind()
    torch.manual_seed(0)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    shard_numels = _unit_shard_numels(GPT(TINY_GPT), world_size)
    units = len(shard_numels)
    gather_bytes = sum(shard_numels) * FP32
    block_gather_bytes = sum(shard_numels[:-1]) * FP32
    reduce_bytes = world_size * sum(shard_numels) * FP32  # every rank's (W, shard_sum) send buffer
    expected = {
        # FULL_SHARD: every block gathered in forward and again in backward; the root once (kept for backward). The
        # first step's counts: the second gathers the last block once (below).
        "FULL_SHARD": (
            {"all_gather": 2 * (units - 1) + 1, reduce: units},
            {"all_gather": gather_bytes + block_gather_bytes, reduce: reduce_bytes},
        ),
        "SHARD_GRAD_OP": (
            {"all_gather": units, reduce: units},
            {"all_gather": gather_bytes, reduce: reduce_bytes},
        ),
        "NO_SHARD": ({"all_reduce": units}, {"all_reduce": sum(p.numel() for p in GPT(TINY_GPT).parameters()) * FP32}),
    }
    if not shared_memory:  # over gloo every rank's part of a collective ends with the collective's stamp
        for counts, nbytes in expected.values():
            for kind, calls in counts.items():
                nbytes[kind] += calls * FRAME_OVERHEAD[kind](world_size)
    # From the second step on, FULL_SHARD keeps the last block gathered from its forward to its backward (see [Note:
    # the last unit stays gathered] in runtime/root.py): one gather of it fewer.
    last_block_bytes = shard_numels[-2] * FP32 + (0 if shared_memory else FRAME_OVERHEAD["all_gather"](world_size))
    for strategy, (first_counts, first_nbytes) in expected.items():
        for prefetch in ("BACKWARD_PRE", "BACKWARD_POST", None):
            torch.manual_seed(0)
            model = fully_shard(GPT(TINY_GPT), {Block}, sharding_strategy=strategy, backward_prefetch=prefetch)
            initialize(model, *batch)
            for step in range(2):  # the first step records the forward order; the second uses it
                counts, nbytes = dict(first_counts), dict(first_nbytes)
                if strategy == "FULL_SHARD" and step == 1:
                    counts["all_gather"] -= 1
                    nbytes["all_gather"] -= last_block_bytes
                counter = _count_one_step(model, batch)
                label = f"{strategy}, backward_prefetch={prefetch}, step {step}"
                moved, moved_bytes = data_moving(counter.counts), data_moving(counter.bytes)
                assert moved == counts, f"[{label}] collectives {moved} != {counts}"
                assert moved_bytes == nbytes, f"[{label}] bytes {moved_bytes} != {nbytes}"
                sizes = {e.group_size for e in counter.events}
                assert sizes == {world_size}, f"[{label}] collectives ran on groups of sizes {sizes}"
    _check_labels_and_log_lines(world_size, shared_memory, batch)


PHASES = {
    "lightning_fsdp.unshard",
    "lightning_fsdp.wait_unshard",
    "lightning_fsdp.reshard",
    "lightning_fsdp.reduce_grads",
    "lightning_fsdp.wait_reduce",
}


def _check_labels_and_log_lines(world_size: int, shared_memory: bool, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A profile names the engine's phases; the root logs its transport (and why) and one debug line."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    engine_log = logging.getLogger("lightning_fsdp.engine")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.DEBUG)
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(*batch).backward()
    engine_log.removeHandler(handler)
    names = {event.name for event in profile.events()}
    assert PHASES <= names, f"missing profiler labels: {PHASES - names}"
    lines = [record.getMessage() for record in records]
    name = "shared memory" if shared_memory else "gloo"
    reason = "every rank maps" if shared_memory else "switched off (LIGHTNING_FSDP_SHARED_MEMORY=0)"
    chosen = [line for line in lines if "transport over" in line]
    assert len(chosen) == 1 and f"{name} transport over {world_size} ranks" in chosen[0] and reason in chosen[0], lines
    roots = [line for line in lines if line.startswith("lightning_fsdp: root GPT")]
    units = f"{TINY_GPT.n_layer + 1} units"
    assert len(roots) == 1 and units in roots[0] and f"{name} x{world_size}" in roots[0], lines


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "gloo"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_collective_per_unit_with_padded_shard_bytes(world_size: int, shared_memory: bool) -> None:
    run_distributed(_check_counts, world_size, shared_memory)
