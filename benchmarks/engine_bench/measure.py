"""What a rank measures in one round: step times, the bytes of its state and of all live tensors, peak RSS,
communication volume and time, and (for --largest) the step's peak."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_fsdp.demos.corpus import load_corpus, random_batches
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter

from .config import CORPUS_BYTES, BenchArgs
from .trainees import Trainee, build, train_step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); any other tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _storages(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (which is updated)."""
    total = 0
    for tensor in tensors:
        with contextlib.suppress(RuntimeError, NotImplementedError):  # e.g. tensors without storage
            storage = _local(tensor).untyped_storage()
            key = (str(storage.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen or storage.filename is not None:
                continue  # a mapped file (ours' shared-memory segments): counted by shared_memory_bytes
            seen.add(key)
            total += storage.nbytes()
    return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state, each storage counted once."""
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    result = {
        "params": _storages(params, seen),
        "grads": _storages((p.grad for p in params if p.grad is not None), seen),
        "optim": _storages(
            (v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)), seen
        ),
    }
    result["total"] = sum(result.values())
    return result


def live_tensor_bytes() -> int:
    """Bytes of every distinct storage behind a tensor the garbage collector can reach.

    Leaves out the fake tensors torch.compile keeps from tracing: they have no memory behind them."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()

    def tensors() -> Iterator[torch.Tensor]:
        for obj in gc.get_objects():
            with contextlib.suppress(Exception):  # some objects raise on isinstance (lazy modules, proxies)
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta" and not isinstance(obj, FakeTensor):
                    yield obj

    return _storages(tensors(), set())


#: How the engine names this process's shared-memory segment in /proc/<pid>/maps
#: (see lightning_fsdp/engine/transport/shm.py).
SEGMENT_NAME = "/memfd:lightning_fsdp-{pid} (deleted)"


def shared_memory_bytes() -> int:
    """What ours' shared-memory transport holds on this rank: the size of this process's own segment as mapped (0 for
    FSDP2 and DDP, and off Linux). The engine allocates a segment whole when it creates it, so its size is its
    memory. Found in ``/proc/self/maps`` by its name, so the benchmark needs none of the engine's internals; the
    other ranks' segments, which this process maps too, are theirs to count."""
    own = SEGMENT_NAME.format(pid=os.getpid())
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    total = 0
    for line in lines:
        fields = line.split(maxsplit=5)  # address range, permissions, offset, device, inode, name
        if len(fields) == 6 and fields[5] == own:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            total += end - start
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def profiled_step(
    trainee: Trainee, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor], args: BenchArgs
) -> tuple[float, dict[str, Any]]:
    """One step under torch.profiler; returns its loss and the collectives' busy and exposed seconds."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        # The profiler starts at a different moment on each rank; without the barrier the first collective
        # of the step would count the other rank's start-up as communication time.
        dist.barrier()
        with record_function("bench::step"):
            loss = train_step(trainee, optimizer, batch, args)
    events = list(prof.events())
    step = next(e for e in events if e.name == "bench::step")
    lo, hi = step.time_range.start, step.time_range.end

    def clipped(e: Any) -> tuple[float, float]:
        return max(lo, e.time_range.start), min(hi, e.time_range.end)

    comm_events = [e for e in events if e.name.startswith(("gloo:", "nccl:")) and e.time_range.end > lo]
    comm = _union([clipped(e) for e in comm_events if e.time_range.start < hi])
    compute = _union([clipped(e) for e in events if e.thread == step.thread and e.name.startswith("aten::")])
    busy_us = _length(comm)
    exposed_us = busy_us - _intersection(comm, compute)
    by_op: dict[str, float] = {}
    for e in comm_events:
        start, end = clipped(e)
        by_op[e.name] = by_op.get(e.name, 0.0) + max(0.0, end - start) * 1e-6
    return loss, {
        "profiled_step_s": (hi - lo) * 1e-6,
        "comm_busy_s": busy_us * 1e-6,
        "comm_exposed_s": exposed_us * 1e-6,
        "comm_busy_by_op_s": by_op,
    }


def peak_step(
    trainee: Trainee,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    args: BenchArgs,
    data_bytes: int,
) -> tuple[float, dict[str, int]]:
    """One step under the profiler's memory events; returns its loss and the peak bytes of all tensors in it.

    The CPU allocator reports each allocation and free to the profiler, but not the free of a block allocated
    before profiling started. So the last step's gradients are freed first, the live tensors are counted then
    (``start``, less ``data_bytes``), and the peak is ``start`` plus the highest running sum of the step's
    allocations and frees. It includes activations and the collectives' temporaries, which the steady state
    bytes leave out.
    """
    optimizer.zero_grad(set_to_none=True)
    start = live_tensor_bytes() + shared_memory_bytes() - data_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = train_step(trainee, optimizer, batch, args)
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = highest = 0
    for _, nbytes in deltas:
        running += nbytes
        highest = max(highest, running)
    return loss, {"step_start_tensor_bytes": start, "step_peak_tensor_bytes": start + highest}


def compile_stats() -> dict[str, int]:
    """What torch.compile did in this process so far: graph breaks (each a fall back to Python between two
    graphs, counted once per compiled frame) and the graphs compiled (recompilations included)."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def run_impl(impl: str, args: BenchArgs, rank: int, world_size: int) -> dict[str, Any]:
    """Train ``impl`` for one round on this rank and measure it; returns this rank's numbers."""
    baseline_rss = peak_rss_bytes()
    tokens = load_corpus(max_bytes=CORPUS_BYTES)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)  # distinct batches per rank
    total_steps = args.warmup + args.steps + 1 + int(args.profile) + int(args.peak)
    batches = [random_batches(tokens, args.batch_size, args.block_size, generator) for _ in range(total_steps)]
    batch_iter = iter(batches)
    # The corpus and the batches (8 bytes a token) are the same under every implementation and no part of
    # what sharding changes: the peak step leaves them out.
    data_bytes = live_tensor_bytes() if args.peak else 0

    trainee = build(impl, args)
    optimizer = torch.optim.AdamW(trainee.model.parameters(), lr=args.lr, foreach=True)
    losses = [train_step(trainee, optimizer, next(batch_iter), args) for _ in range(args.warmup)]
    step_times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(train_step(trainee, optimizer, next(batch_iter), args))
        step_times.append(time.perf_counter() - start)
    train_peak_rss = peak_rss_bytes()  # before the counted / profiled steps, whose tooling allocates too
    compiled = compile_stats() if args.compile is not None else {}  # before the tooling's steps, which may recompile

    with CollectiveCounter() as comm:
        losses.append(train_step(trainee, optimizer, next(batch_iter), args))
    memory = state_bytes(trainee.model, optimizer)
    live = live_tensor_bytes() + shared_memory_bytes()
    comm_time: dict[str, Any] = {}
    if args.profile:
        loss, comm_time = profiled_step(trainee, optimizer, next(batch_iter), args)
        losses.append(loss)
    peak: dict[str, int] = {}
    if args.peak:
        loss, peak = peak_step(trainee, optimizer, next(batch_iter), args, data_bytes)
        losses.append(loss)
    return {
        "impl": impl,
        "rank": rank,
        "num_params": trainee.num_params,
        "losses": losses,
        "step_times_s": step_times,
        "state_bytes": memory,
        "live_tensor_bytes": live,
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_bytes": train_peak_rss,
        "comm_counts": dict(comm.counts),
        "comm_bytes": dict(comm.bytes),
        **comm_time,
        **peak,
        **compiled,
    }
