"""CollectiveCounter must count every collective exactly once, under its normalised kind, with the bytes this rank
sent, because engine tests ("one all-gather per unit") and the benchmark's bytes-per-step rest on it."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial

from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter, CollectiveEvent, classify
from tests.distributed import run_distributed


def _one_of_each_collective(rank: int, world_size: int) -> None:
    # Distinct sizes and dtypes per collective, so a byte count taken from the wrong argument (the output
    # instead of the input) or a wrong element size shows up as a wrong number.
    shard = torch.full((5,), float(rank))  # all-gather input: 5 x fp32 = 20 B
    gathered = torch.empty(5 * world_size)
    unreduced = torch.ones(3 * world_size, dtype=torch.float64)  # reduce-scatter input: 6 x fp64 = 48 B
    reduced = torch.empty(3, dtype=torch.float64)
    summed = torch.full((7,), rank, dtype=torch.int64)  # all-reduce: 7 x int64 = 56 B
    a2a_in = torch.arange(4 * world_size, dtype=torch.float32) + 100 * rank  # all-to-all input: 8 x fp32 = 32 B
    a2a_out = torch.empty_like(a2a_in)

    with CollectiveCounter() as comm:
        dist.all_gather_single(gathered, shard)
        dist.reduce_scatter_single(reduced, unreduced)
        dist.all_reduce(summed, async_op=True).wait()  # an async handle is still one collective
        dist.all_to_all_single(a2a_out, a2a_in)
    dist.barrier()  # outside the context: must not be recorded

    # The mode passes the collectives through unchanged.
    assert gathered.tolist() == [float(r) for r in range(world_size) for _ in range(5)]
    assert reduced.tolist() == [float(world_size)] * 3
    assert summed.tolist() == [sum(range(world_size))] * 7
    assert a2a_out[:4].tolist() == [float(4 * rank + i) for i in range(4)]

    assert dict(comm.counts) == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1, "all_to_all": 1}
    assert dict(comm.bytes) == {"all_gather": 20, "reduce_scatter": 48, "all_reduce": 56, "all_to_all": 32}
    assert comm.events == [
        CollectiveEvent("all_gather", "c10d::_allgather_base_", 20, 5, torch.float32, world_size),
        CollectiveEvent("reduce_scatter", "c10d::_reduce_scatter_base_", 48, 6, torch.float64, world_size),
        CollectiveEvent("all_reduce", "c10d::allreduce_", 56, 7, torch.int64, world_size),
        CollectiveEvent("all_to_all", "c10d::alltoall_base_", 32, 8, torch.float32, world_size),
    ]
    assert comm.counts["broadcast"] == 0  # a kind that never happened reads as zero

    comm.reset()
    assert not comm.events and not comm.counts and not comm.bytes


def _deprecated_names_backward_hooks_dtensors_and_barriers(rank: int, world_size: int) -> None:
    shard = torch.ones(4)
    weight = torch.ones(3, requires_grad=True)
    # An engine reduces gradients from autograd hooks: those collectives must be seen too.
    weight.register_hook(lambda grad: dist.all_reduce(grad) or grad)
    with CollectiveCounter() as comm, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor is deprecated in torch 2.13
        dist.all_gather_into_tensor(torch.empty(4 * world_size), shard)
        dist.broadcast(shard, src=0)
        (weight * 2).sum().backward()
        dist.barrier()
    assert dict(comm.counts) == {"all_gather": 1, "broadcast": 1, "all_reduce": 1, "barrier": 1}
    assert dict(comm.bytes) == {"all_gather": 16, "broadcast": 16, "all_reduce": 12, "barrier": 0}

    # A DTensor issues its collectives from inside its own dispatch; they must be seen too (clipping a
    # DTensor gradient norm all-reduces a Partial value exactly like this).
    mesh = init_device_mesh("cpu", (world_size,))
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    comm.reset()
    with comm:
        replicated = partial.full_tensor()
    assert replicated.tolist() == [float(world_size)] * 3
    assert dict(comm.counts) == {"all_reduce": 1} and dict(comm.bytes) == {"all_reduce": 12}

    # Records accumulate over re-entries until reset().
    with comm:
        dist.all_reduce(shard)
    assert comm.counts["all_reduce"] == 2 and comm.bytes["all_reduce"] == 28


def test_counts_and_bytes_of_one_of_each_collective() -> None:
    run_distributed(_one_of_each_collective, 2, timeout=120.0)


def test_deprecated_names_backward_hooks_dtensors_and_barriers_are_counted() -> None:
    run_distributed(_deprecated_names_backward_hooks_dtensors_and_barriers, 2, timeout=120.0)


def test_classify_normalises_op_names() -> None:
    assert classify("c10d::_allgather_base_") == "all_gather"
    assert classify("c10d::allgather_into_tensor_coalesced_.default") == "all_gather"
    assert classify("_c10d_functional::reduce_scatter_tensor") == "reduce_scatter"
    assert classify("c10d::allreduce_coalesced_") == "all_reduce"
    assert classify("c10d::alltoall_base_") == "all_to_all"
    assert classify("c10d::broadcast_") == "broadcast"
    assert classify("c10d::some_future_op_") == "other"
