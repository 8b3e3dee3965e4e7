"""Our FSDP engine against torch's FSDP2 and DDP: step time, memory, communication and loss, on one machine.

    python benchmarks/bench_engine.py                        # 2 gloo ranks, 1 thread each, fp32, ~25M params
    python benchmarks/bench_engine.py --preset tiny          # seconds, for a smoke test
    python benchmarks/bench_engine.py --impls fsdp2,ddp --json benchmarks/results/run.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_engine.py   # same, under torchrun
    python benchmarks/bench_engine.py --world-size 1 --impls ours,plain   # one rank: ours against the module itself
    python benchmarks/bench_engine.py --preset tiny --compile inductor   # every implementation torch.compile'd alike
    python benchmarks/bench_engine.py --largest --batch-size 1 --json benchmarks/results/largest.json
    python benchmarks/bench_engine.py --from-json benchmarks/results/run.json benchmarks/results/largest.json \
        --plot benchmarks/plot.png                        # re-print and draw saved runs, without running

Why it is built this way:

- The same demo GPT, seed, data (each rank its own batches from the stdlib corpus), optimizer (AdamW, foreach)
  and gradient clipping run under each implementation, so the only difference is the parallelism. The final
  losses must agree; a disagreement is printed as a WARNING line because it means one of them is wrong.
- Implementations are interleaved round by round (ours, fsdp2, ddp, ours, fsdp2, ddp, ...): the machine is
  shared, and noise that comes and goes then hits all of them alike instead of whichever ran during it.
- Without torchrun, each (round, implementation) runs in freshly spawned processes. ``ru_maxrss`` is a
  process-lifetime peak, so only a fresh process gives each implementation its own peak. Under torchrun all
  of them share the processes and the reported peak RSS is the running peak (marked "not isolated").
- Step time is per step the slowest rank's wall time (collectives make the ranks wait for each other anyway),
  and the median over all timed steps of all rounds.
- Memory is counted, not sampled: after a step (gradients still alive), the distinct storages behind the
  parameters, gradients and optimizer state, so a shard stored inside a padded buffer counts the buffer, and
  a freed (resized to 0) unsharded parameter counts nothing. DTensors (FSDP2) count their local tensors. The
  "live tensors" figure is the same over every tensor the garbage collector can reach, which catches buffers
  an engine keeps alive outside the parameters, plus the slots of our shared-memory segment that collectives
  have written (a mapped file is counted by what is resident, not by its size).
- Communication volume is counted with ``CollectiveCounter`` (lightning_fsdp/engine/comm_stats.py) on one extra
  step that is not timed, because its dispatch mode slows every operator.
- Communication time comes from ``torch.profiler`` on one more untimed step: "comm busy" is the union of the
  intervals in which the backend (gloo's worker threads) runs a collective; "comm exposed" is the part of it
  during which the training thread runs no compute operator. The latter is an upper bound on waiting: Python
  work between operators (hooks, bookkeeping) also counts as exposed. The same rule applies to all three.
- ``--largest`` turns the paper's "significantly larger models" into one number: at a fixed per-rank budget (by
  default what DDP's parameters, gradients and optimizer state measure on the chosen model), the largest model
  each strategy fits according to ``lightning_fsdp.estimate``, and one measured step of a model that the estimator
  says fits FULL_SHARD but not DDP. Its peak is measured too (allocator events under ``torch.profiler``), because
  the steady bytes after a step leave out the units gathered during it.
- ``--plot`` draws step time, memory per implementation and memory against model size (the estimator's lines
  with the measured points on them) into one PNG, from the same payload ``--json`` writes, so a saved run can
  be drawn again with ``--from-json``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

# Run as a script (`python benchmarks/bench_engine.py`) from a checkout where the package is not installed:
# make the repository root importable, as `pip install -e .` would.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("lightning_fsdp") is None:
    sys.path.insert(0, str(_REPO_ROOT))

from lightning_fsdp.demos.corpus import VOCAB_SIZE, load_corpus, random_batches  # noqa: E402
from lightning_fsdp.demos.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig  # noqa: E402
from lightning_fsdp.engine.comm_stats import CollectiveCounter  # noqa: E402
from lightning_fsdp.engine.registry import units_under  # noqa: E402
from lightning_fsdp.estimate import MemoryEstimate, estimate_memory, largest_trainable  # noqa: E402
from lightning_fsdp.process_exit import exit_now  # noqa: E402

IMPLS = ("ours", "fsdp2", "ddp", "plain")  # plain: the module itself, no parallelism (world size 1 only)
DEFAULT_IMPLS = ("ours", "fsdp2", "ddp")

PRESETS: dict[str, dict[str, int]] = {
    # ~25M parameters: large enough that communication and optimizer state matter, small enough for a
    # 2-core machine (one fp32 step takes seconds with one thread per rank).
    "default": {"n_layer": 8, "n_embd": 512, "n_head": 8, "block_size": 128, "batch_size": 4},
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 32, "batch_size": 4},
}

#: Relative tolerance on the final loss between implementations. fp32 differs only in reduction order;
#: bf16 also differs in where each implementation casts (FSDP: all-gather in bf16; DDP: autocast).
LOSS_RTOL = {"fp32": 1e-3, "bf16": 3e-2}

CORPUS_BYTES = 1_000_000


@dataclass(frozen=True)
class BenchArgs:
    """Everything a rank needs, picklable so it can be handed to spawned processes."""

    impls: tuple[str, ...]
    world_size: int
    threads: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int
    warmup: int
    steps: int
    rounds: int
    precision: str
    sharding_strategy: str
    lr: float
    max_grad_norm: float
    seed: int
    profile: bool
    timeout: float
    json: str | None
    plot: str | None = None
    largest: bool = False
    budget_mib: float | None = None
    from_json: tuple[str, ...] = ()
    # One more untimed step under the profiler's memory events, for the step's peak (--largest uses it).
    peak: bool = False
    # Gather the next block during this one's forward: ours with forward_prefetch=True, FSDP2 with
    # set_modules_to_forward_prefetch (each its documented way); off by default in both.
    forward_prefetch: bool = False
    # The sharding units: every Block, or every Block's attention and MLP (smaller units, less gathered at once).
    wrap: str = "block"
    # torch.compile the whole (parallelised) model with this backend; None: eager.
    compile: str | None = None

    def wrapped(self) -> set[type[nn.Module]]:
        return {Block} if self.wrap == "block" else {CausalSelfAttention, MLP}

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=VOCAB_SIZE,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )


# --------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> BenchArgs:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default", help="model and batch sizes")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="overrides the preset")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every implementation once")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--sharding-strategy",
        type=str.upper,
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        help="for ours (FSDP2 runs FULL_SHARD; DDP replicates)",
    )
    parser.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="prefetch the next block's parameters in forward, in ours and in fsdp2 (off by default in both)",
    )
    parser.add_argument(
        "--wrap",
        choices=["block", "sublayer"],
        default="block",
        help="sharding units, in ours and in fsdp2: each Block, or each Block's attention and MLP",
    )
    parser.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="torch.compile the whole model of every implementation with this backend (inductor, aot_eager)",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping; 0 disables it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step (no comm time)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per (round, impl) before giving up")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number (and raw data) here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the results into this PNG (matplotlib)")
    parser.add_argument(
        "--largest",
        action="store_true",
        help="instead of the comparison: the largest model ours and DDP fit in --budget-mib, estimated and measured",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="per-rank budget for --largest (default: DDP's measured params+grads+optim on the chosen model)",
    )
    parser.add_argument(
        "--from-json",
        nargs="+",
        default=(),
        metavar="PATH",
        help="run nothing: re-print (and --plot) these saved --json files (a comparison and/or a --largest run)",
    )
    ns = parser.parse_args(argv)

    sizes = {
        name: getattr(ns, name) if getattr(ns, name) is not None else value
        for name, value in PRESETS[ns.preset].items()
    }
    impls = tuple(name.strip() for name in ns.impls.split(",") if name.strip())
    if unknown := sorted(set(impls) - set(IMPLS)):
        parser.error(f"unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
    if "plain" in impls and ns.world_size != 1:
        parser.error("--impls plain (the module without parallelism) needs --world-size 1")
    if sizes["n_embd"] % sizes["n_head"]:
        parser.error(f"--n-embd {sizes['n_embd']} must be a multiple of --n-head {sizes['n_head']}")
    if ns.steps < 1 or ns.rounds < 1 or ns.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return BenchArgs(
        impls=impls,
        world_size=ns.world_size,
        threads=ns.threads,
        warmup=ns.warmup,
        steps=ns.steps,
        rounds=ns.rounds,
        precision=ns.precision,
        sharding_strategy=ns.sharding_strategy,
        lr=ns.lr,
        max_grad_norm=ns.max_grad_norm,
        seed=ns.seed,
        profile=not ns.no_profile,
        timeout=ns.timeout,
        json=ns.json,
        plot=ns.plot,
        largest=ns.largest,
        budget_mib=ns.budget_mib,
        from_json=tuple(ns.from_json),
        forward_prefetch=ns.forward_prefetch,
        wrap=ns.wrap,
        compile=ns.compile,
        **sizes,
    )


# ------------------------------------------------------------------------------- the three implementations


@dataclass
class Trainee:
    """A model under one implementation, and how to clip its gradients and run its forward."""

    model: nn.Module
    clip: Callable[[Iterable[torch.Tensor], float], Any]
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    num_params: int  # of the whole model, counted before sharding


def build(impl: str, args: BenchArgs) -> Trainee:
    """The demo GPT, identical on every rank (same seed), parallelised by ``impl``, compiled if asked."""
    trainee = _parallelised(impl, args)
    if args.compile is not None:
        trainee.model = torch.compile(trainee.model, backend=args.compile)
    return trainee


def _parallelised(impl: str, args: BenchArgs) -> Trainee:
    torch.manual_seed(args.seed)
    model = GPT(args.gpt_config())
    num_params = sum(p.numel() for p in model.parameters())
    bf16 = args.precision == "bf16"
    no_autocast = contextlib.nullcontext

    def autocast() -> contextlib.AbstractContextManager[Any]:  # DDP and the plain module: bf16 by autocast
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    if impl == "ours":
        from lightning_fsdp import clip_grad_norm_, fully_shard

        kwargs: dict[str, Any] = {
            "policy": args.wrapped(),
            "sharding_strategy": args.sharding_strategy,
            "forward_prefetch": args.forward_prefetch,
        }
        if bf16:
            if "mixed_precision" not in inspect.signature(fully_shard).parameters:
                raise RuntimeError("ours: fully_shard takes no mixed_precision yet; run with --precision fp32")
            from lightning_fsdp import MixedPrecision

            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, **kwargs)
        return Trainee(model, clip_grad_norm_, no_autocast, num_params)
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        kwargs = {"mp_policy": policy} if policy is not None else {}
        units = [m for m in model.modules() if isinstance(m, tuple(args.wrapped()))]
        for unit in units:
            fsdp2_fully_shard(unit, **kwargs)
        fsdp2_fully_shard(model, **kwargs)
        if args.forward_prefetch:
            for unit, next_unit in zip(units, units[1:], strict=False):
                unit.set_modules_to_forward_prefetch([next_unit])
        return Trainee(model, torch.nn.utils.clip_grad_norm_, no_autocast, num_params)
    if impl == "ddp":
        # The demo's only buffers are constant causal masks: broadcasting them every forward (DDP's default)
        # would add traffic the FSDP implementations do not have.
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
        return Trainee(ddp, torch.nn.utils.clip_grad_norm_, autocast, num_params)
    if impl == "plain":
        return Trainee(model, torch.nn.utils.clip_grad_norm_, autocast, num_params)
    raise ValueError(f"unknown implementation {impl!r}")


def train_step(
    trainee: Trainee, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor], args: BenchArgs
) -> float:
    """One optimizer step; gradients are freed at the start, so they are alive (and counted) after it."""
    optimizer.zero_grad(set_to_none=True)
    inputs, targets = batch
    with trainee.autocast():
        loss = trainee.model(inputs, targets)
    loss.backward()
    if args.max_grad_norm > 0:
        trainee.clip(trainee.model.parameters(), args.max_grad_norm)
    optimizer.step()
    return loss.item()


# ----------------------------------------------------------------------------------------------- measuring


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
    """Bytes of every distinct storage behind a tensor the garbage collector can reach."""
    gc.collect()

    def tensors() -> Iterator[torch.Tensor]:
        for obj in gc.get_objects():
            with contextlib.suppress(Exception):  # some objects raise on isinstance (lazy modules, proxies)
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    yield obj

    return _storages(tensors(), set())


def shared_memory_bytes(model: nn.Module) -> int:
    """What ours' shared-memory transport holds on this rank: the slots written (0 for FSDP2 and DDP)."""
    units = units_under(model)
    transport = units[0].transport() if units else None
    return transport.resident_bytes if transport is not None else 0


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
    start = live_tensor_bytes() + shared_memory_bytes(trainee.model) - data_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = train_step(trainee, optimizer, batch, args)
    events = prof.profiler.kineto_results.events() if prof.profiler is not None else []
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    running = highest = 0
    for _, nbytes in deltas:
        running += nbytes
        highest = max(highest, running)
    return loss, {"step_start_tensor_bytes": start, "step_peak_tensor_bytes": start + highest}


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

    with CollectiveCounter() as comm:
        losses.append(train_step(trainee, optimizer, next(batch_iter), args))
    memory = state_bytes(trainee.model, optimizer)
    live = live_tensor_bytes() + shared_memory_bytes(trainee.model)
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
    }


# ------------------------------------------------------------------------------------------------ launching


def _prepare_rank(args: BenchArgs) -> None:
    """Threads, and the imports every implementation's process pays for, so RSS baselines are comparable."""
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's deprecated collective names
    importlib.import_module("torch.distributed.fsdp")
    with contextlib.suppress(ImportError):
        importlib.import_module("lightning_fsdp")


def _spawned_rank(rank: int, impl: str, args: BenchArgs, port: int, out: str) -> None:
    # A native crash (abort, segfault) otherwise leaves only a signal number; this prints where Python was.
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _prepare_rank(args)
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size, timeout=timedelta(seconds=args.timeout))
    try:
        result = run_impl(impl, args, rank, args.world_size)
        gathered: list[Any] | None = [None] * args.world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/process_exit.py


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_impl(impl: str, args: BenchArgs) -> list[dict[str, Any]] | str:
    """Run one round of ``impl`` in fresh processes; the per-rank results, or why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        context = mp.start_processes(
            _spawned_rank,
            args=(impl, args, _free_port(), out),
            nprocs=args.world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    return f"timed out after {args.timeout:g} s"
        except mp.ProcessRaisedException as err:
            return f"rank {err.error_index} raised:{err.msg}"
        except mp.ProcessExitedException as err:
            return f"rank {err.error_index} died: {err.msg}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        return json.loads(Path(out).read_text())


def available_impls(args: BenchArgs) -> tuple[list[str], dict[str, str]]:
    """The implementations that can run here with these arguments, and why the others cannot.

    Checked up front so that a missing feature costs one line, not a spawned round per failure.
    """
    usable, skipped = [], {}
    for impl in args.impls:
        if impl == "ours":
            try:
                from lightning_fsdp import clip_grad_norm_, fully_shard  # noqa: F401
            except ImportError as err:
                skipped[impl] = f"cannot import fully_shard / clip_grad_norm_ from lightning_fsdp: {err}"
                continue
            if args.precision != "fp32" and "mixed_precision" not in inspect.signature(fully_shard).parameters:
                skipped[impl] = (
                    f"fully_shard takes no mixed_precision argument yet, needed for --precision {args.precision}"
                )
                continue
        usable.append(impl)
    return usable, skipped


def run_all_spawned(args: BenchArgs, impls: list[str]) -> dict[str, list[list[dict[str, Any]] | str]]:
    """Every round runs every implementation once, in that order, each in its own processes."""
    results: dict[str, list[list[dict[str, Any]] | str]] = {impl: [] for impl in impls}
    for round_index in range(args.rounds):
        for impl in impls:
            start = time.monotonic()
            outcome = spawn_impl(impl, args)
            if isinstance(outcome, str):
                # One retry: rare native crashes of gloo/the profiler on a loaded machine should not void a
                # round; the failure is still printed and counted.
                print(f"  {impl} failed, retrying once: {outcome.strip()[-3000:]}", flush=True)
                results[impl].append(outcome)
                outcome = spawn_impl(impl, args)
            status = "ok" if isinstance(outcome, list) else "FAILED"
            print(
                f"round {round_index + 1}/{args.rounds} {impl:6s} {status} in {time.monotonic() - start:.1f} s",
                flush=True,
            )
            if isinstance(outcome, str):
                print(f"  {impl} failed: {outcome.strip()[-3000:]}", flush=True)
            results[impl].append(outcome)
    return results


def run_all_torchrun(args: BenchArgs, impls: list[str]) -> dict[str, list[list[dict[str, Any]] | str]] | None:
    """The same rounds inside torchrun's processes (shared, so peak RSS is not isolated); rank 0 gets all."""
    _prepare_rank(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[list[dict[str, Any]] | str]] = {impl: [] for impl in impls}
    try:
        for round_index in range(args.rounds):
            for impl in impls:
                result = run_impl(impl, args, rank, world_size)
                gathered: list[Any] | None = [None] * world_size if rank == 0 else None
                dist.gather_object(result, gathered, dst=0)
                if rank == 0:
                    print(f"round {round_index + 1}/{args.rounds} {impl:6s} ok", flush=True)
                    results[impl].append(gathered)  # type: ignore[arg-type]
                gc.collect()
    finally:
        dist.destroy_process_group()
    return results if rank == 0 else None


# ------------------------------------------------------------------------------------------------ reporting


def summarize(impl: str, rounds: list[list[dict[str, Any]] | str], args: BenchArgs) -> dict[str, Any]:
    """One implementation's numbers over its successful rounds (per rank: the worst rank; loss: rank mean)."""
    ok = [r for r in rounds if isinstance(r, list)]
    failures = [r for r in rounds if isinstance(r, str)]
    if not ok:
        return {"impl": impl, "ok": False, "failures": failures}
    step_times = [max(ranks) for round_ in ok for ranks in zip(*(r["step_times_s"] for r in round_), strict=True)]
    round_medians = [
        statistics.median(max(ranks) for ranks in zip(*(r["step_times_s"] for r in round_), strict=True))
        for round_ in ok
    ]
    loss_curves = [
        [statistics.fmean(ranks) for ranks in zip(*(r["losses"] for r in round_), strict=True)] for round_ in ok
    ]
    first = ok[0]
    summary: dict[str, Any] = {
        "impl": impl,
        "ok": True,
        "failures": failures,
        "rounds_ok": len(ok),
        "num_params": first[0]["num_params"],
        "step_time_median_s": statistics.median(step_times),
        # Noise on a shared machine only ever adds time, so the fastest step is the steadier comparison.
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_round_medians_s": round_medians,
        "state_bytes": {k: max(r["state_bytes"][k] for r in first) for k in first[0]["state_bytes"]},
        "live_tensor_bytes": max(r["live_tensor_bytes"] for r in first),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for round_ in ok for r in round_),
        "peak_rss_delta_bytes": max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for round_ in ok for r in round_),
        "comm_counts": first[0]["comm_counts"],
        "comm_bytes": first[0]["comm_bytes"],
        "comm_bytes_same_on_all_ranks": all(r["comm_bytes"] == first[0]["comm_bytes"] for r in first),
        "final_loss": loss_curves[0][-1],
        "loss_curve": loss_curves[0],
        "loss_same_every_round": all(curve == loss_curves[0] for curve in loss_curves),
    }
    if args.profile:
        summary["profiled_step_s"] = statistics.median(max(r["profiled_step_s"] for r in round_) for round_ in ok)
        summary["comm_busy_s"] = statistics.median(statistics.fmean(r["comm_busy_s"] for r in round_) for round_ in ok)
        summary["comm_exposed_s"] = statistics.median(
            statistics.fmean(r["comm_exposed_s"] for r in round_) for round_ in ok
        )
    return summary


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def report(summaries: dict[str, dict[str, Any]], args: BenchArgs, rss_isolated: bool) -> list[str]:
    """The tables (and WARNING lines) printed at the end; returned so they can also go into the JSON."""
    ok = {impl: s for impl, s in summaries.items() if s["ok"]}
    lines = []
    label = "ours" if args.sharding_strategy == "FULL_SHARD" else f"ours({args.sharding_strategy})"
    if ok:
        any_summary = next(iter(ok.values()))
        lines.append(
            f"model: {any_summary['num_params'] / 1e6:.1f}M params, n_layer={args.n_layer} n_embd={args.n_embd} "
            f"n_head={args.n_head} block={args.block_size} batch={args.batch_size}/rank; W={args.world_size} "
            f"gloo ranks, {args.threads} thread(s) each, {args.precision}; {args.rounds} rounds x "
            f"({args.warmup} warmup + {args.steps} timed) steps"
            + ("; forward prefetch on (ours and fsdp2)" if args.forward_prefetch else "")
        )
    # Under torchrun the implementations share processes: the peak is whichever came first's, so no ratio.
    rss_note = "" if rss_isolated else " (not isolated)"
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("step time (median)", lambda s: f"{s['step_time_median_s'] * 1e3:.0f} ms"),
        ("step time (min)", lambda s: f"{s['step_time_min_s'] * 1e3:.0f} ms"),
        ("  round medians", lambda s: " ".join(f"{t * 1e3:.0f}" for t in s["step_time_round_medians_s"])),
        ("params", lambda s: _mb(s["state_bytes"]["params"])),
        ("grads", lambda s: _mb(s["state_bytes"]["grads"])),
        ("optimizer state", lambda s: _mb(s["state_bytes"]["optim"])),
        ("params+grads+optim", lambda s: _mb(s["state_bytes"]["total"])),
        ("all live tensors", lambda s: _mb(s["live_tensor_bytes"])),
        ("peak RSS" + rss_note, lambda s: _mb(s["peak_rss_bytes"])),
        ("peak RSS - baseline" + rss_note, lambda s: _mb(s["peak_rss_delta_bytes"])),
    ]
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"):
        rows.append(
            (f"{kind} /step/rank", lambda s, k=kind: f"{_mb(s['comm_bytes'].get(k, 0))} ({s['comm_counts'].get(k, 0)})")
        )
    if args.profile:
        rows.append(("profiled step", lambda s: f"{s['profiled_step_s'] * 1e3:.0f} ms"))
        rows.append(("comm busy /step", lambda s: f"{s['comm_busy_s'] * 1e3:.0f} ms"))
        rows.append(("comm exposed /step", lambda s: f"{s['comm_exposed_s'] * 1e3:.0f} ms"))
    rows.append(("final loss", lambda s: f"{s['final_loss']:.5f}"))
    names = [label if impl == "ours" else impl for impl in ok]
    width = max(24, *(len(r[0]) for r in rows))
    lines.append(f"{'':{width}s}" + "".join(f"{name:>22s}" for name in names))
    for title, cell in rows:
        lines.append(f"{title:{width}s}" + "".join(f"{cell(s):>22s}" for s in ok.values()))

    for impl, s in summaries.items():
        if not s["ok"]:
            lines.append(f"WARNING: {impl} failed in every attempt: {s['failures'][0].strip()[-500:]}")
        elif s["failures"]:
            lines.append(
                f"WARNING: {impl}: {len(s['failures'])} attempt(s) failed and were retried; the first: "
                f"{s['failures'][0].strip()[-300:]}"
            )
        elif not s["loss_same_every_round"]:
            lines.append(f"WARNING: {impl} is not deterministic: its losses differ between rounds")
        if s["ok"] and not s["comm_bytes_same_on_all_ranks"]:
            lines.append(f"WARNING: {impl}: ranks disagree on bytes communicated per step")
    reference = next(iter(ok.values()), None)
    rtol = LOSS_RTOL[args.precision]
    for impl, s in ok.items():
        if reference is None or impl == reference["impl"]:
            continue
        # Every step, not only the last: a wrong gradient shows up in the step after it, and may fade later.
        for step, (mine, theirs) in enumerate(zip(s["loss_curve"], reference["loss_curve"], strict=True)):
            if abs(mine - theirs) > rtol * abs(theirs):
                lines.append(
                    f"WARNING: losses disagree beyond rtol {rtol:g} at step {step + 1}: {impl} {mine:.6f} vs "
                    f"{reference['impl']} {theirs:.6f}"
                )
                break

    if "ours" in ok:
        ours = ok["ours"]
        others = [impl for impl in ("fsdp2", "ddp", "plain") if impl in ok]
        if others:
            lines.append("")
            lines.append(f"{'ratio':{width}s}" + "".join(f"{label + '/' + o:>22s}" for o in others))
            ratio_rows: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
                ("step time (median)", lambda s: s["step_time_median_s"]),
                ("step time (min)", lambda s: s["step_time_min_s"]),
                ("params+grads+optim", lambda s: s["state_bytes"]["total"]),
                ("all live tensors", lambda s: s["live_tensor_bytes"]),
                ("bytes communicated", lambda s: sum(s["comm_bytes"].values())),
            ]
            if rss_isolated:
                ratio_rows += [
                    ("peak RSS", lambda s: s["peak_rss_bytes"]),
                    ("peak RSS - baseline", lambda s: s["peak_rss_delta_bytes"]),
                ]
            if args.profile:
                ratio_rows.append(("comm exposed", lambda s: s["comm_exposed_s"]))
            for title, value in ratio_rows:
                lines.append(f"{title:{width}s}" + "".join(f"{_ratio(value(ours), value(ok[o])):>22s}" for o in others))
    return lines


def source_state() -> dict[str, Any]:
    """Which code the numbers come from: the commit, and a hash of the engine's files as they were on disk.

    The engine changes under the benchmark while people work on it; the hash tells two runs of the same
    commit apart when the working tree differed.
    """
    digest = hashlib.sha1()
    for path in sorted((_REPO_ROOT / "lightning_fsdp" / "engine").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    commit = subprocess.run(
        ["git", "-C", str(_REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(_REPO_ROOT), "status", "--porcelain", "--", "lightning_fsdp"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {"commit": commit or None, "lightning_fsdp_modified": bool(dirty), "engine_sha1": digest.hexdigest()[:12]}


def source_line(source: dict[str, Any]) -> str:
    """The report's first line: which code produced the numbers (see :func:`source_state`)."""
    modified = " + uncommitted changes in lightning_fsdp/" if source["lightning_fsdp_modified"] else ""
    return f"code: commit {source['commit']}{modified} (engine files sha1 {source['engine_sha1']})"


# ----------------------------------------------------------------------------------------- largest model


@dataclass(frozen=True)
class ModelFamily:
    """The demo GPT at one width, by depth: its parameter count is exactly ``root + n_layer * block``.

    Depth is the knob because it leaves the largest sharding unit (a ``Block``, or its MLP under ``--wrap
    sublayer``) the same size, so the estimator's working set of gathered units stays fixed while the sharded
    part grows. Parameters of a layer outside every unit (the layer norms under ``--wrap sublayer``) belong to
    the root unit, which therefore grows by ``root_per_layer`` a layer.
    """

    block: int  # parameters of one layer (a Block)
    root: int  # parameters outside the blocks (tied embedding and head, positions, final norm)
    unit: int  # parameters of the largest sharding unit
    root_per_layer: int = 0  # parameters of a layer that no unit of that layer owns

    def params(self, n_layer: int) -> int:
        return self.root + n_layer * self.block

    def deepest(self, max_params: int) -> int:
        """The most layers whose model has at most ``max_params`` parameters."""
        return max(0, (max_params - self.root) // self.block)

    def root_unit(self, num_params: int) -> int:
        return self.root + self.root_per_layer * max(0, num_params - self.root) // self.block

    def estimate(self, num_params: int, world_size: int, strategy: str) -> MemoryEstimate:
        return estimate_memory(
            num_params, world_size, strategy, largest_unit=self.unit, root_unit=self.root_unit(num_params)
        )

    def largest(self, budget_bytes: int, world_size: int, strategy: str) -> int:
        # The root grows with depth (by root_per_layer); take it at the deepest model the budget could hold with
        # no working set at all, which overstates it by a few layer norms at most: conservative.
        deepest = largest_trainable(budget_bytes, world_size, strategy, largest_unit=0, root_unit=0)
        return largest_trainable(
            budget_bytes, world_size, strategy, largest_unit=self.unit, root_unit=self.root_unit(deepest)
        )


def model_family(args: BenchArgs) -> ModelFamily:
    """Count one block, its units and the rest on the meta device (no memory), at the width ``args`` gives."""
    with torch.device("meta"):
        model = GPT(replace(args.gpt_config(), n_layer=1))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    units = [m for m in model.blocks[0].modules() if isinstance(m, tuple(args.wrapped()))]
    unit_sizes = [sum(p.numel() for p in unit.parameters()) for unit in units]
    return ModelFamily(
        block=block,
        root=sum(p.numel() for p in model.parameters()) - block,
        unit=max(unit_sizes),
        root_per_layer=block - sum(unit_sizes),
    )


def largest_at(family: ModelFamily, budget_bytes: int, world_size: int) -> dict[str, Any]:
    """The largest DDP and FULL_SHARD models whose estimated per-rank peak fits ``budget_bytes``."""
    ddp = family.largest(budget_bytes, world_size, "DDP")
    full_shard = family.largest(budget_bytes, world_size, "FULL_SHARD")
    return {
        "budget_bytes": budget_bytes,
        "ddp_params": ddp,
        "full_shard_params": full_shard,
        "ratio": full_shard / ddp if ddp else None,
        "ddp_layers": family.deepest(ddp),
        "full_shard_layers": family.deepest(full_shard),
    }


def _one_step_summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A --largest run's numbers: the worst rank's bytes, the rank-mean loss curve."""
    return {
        "num_params": ranks[0]["num_params"],
        "state_bytes": {k: max(r["state_bytes"][k] for r in ranks) for k in ranks[0]["state_bytes"]},
        "step_start_tensor_bytes": max(r["step_start_tensor_bytes"] for r in ranks),
        "step_peak_tensor_bytes": max(r["step_peak_tensor_bytes"] for r in ranks),
        "loss_curve": [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks), strict=True)],
    }


def run_largest(args: BenchArgs) -> dict[str, Any]:
    """Estimate the largest model each strategy fits in the budget, then measure a step of one in between."""
    source = source_state()
    family = model_family(args)
    world_size = args.world_size
    one_step = replace(args, warmup=0, steps=1, rounds=1, profile=False)
    if args.budget_mib is not None:
        budget = int(args.budget_mib * 2**20)
        budget_source = "--budget-mib"
    else:
        start = time.monotonic()
        outcome = spawn_impl("ddp", one_step)
        print(f"budget: ddp on the {args.n_layer}-layer model in {time.monotonic() - start:.1f} s", flush=True)
        if isinstance(outcome, str):
            raise SystemExit(f"ddp on the {args.n_layer}-layer model failed, so there is no budget: {outcome}")
        budget = max(r["state_bytes"]["total"] for r in outcome)
        budget_source = (
            f"DDP's measured params+grads+optim on the {args.n_layer}-layer model "
            f"({family.params(args.n_layer) / 1e6:.1f}M params)"
        )
    at_budget = largest_at(family, budget, world_size)
    # How the ratio grows with the budget: the gathered units are a fixed cost that matters less and less.
    scan = [largest_at(family, budget * factor, world_size) for factor in (1, 2, 4, 8)]
    n_layer = at_budget["full_shard_layers"]
    if n_layer <= at_budget["ddp_layers"]:
        raise SystemExit(
            f"at {budget / 2**20:.1f} MiB no whole number of layers fits FULL_SHARD but not DDP; raise --budget-mib"
        )
    big = replace(one_step, n_layer=n_layer, peak=True)
    measured: dict[str, Any] = {}
    for impl in ("ours", "ddp"):
        start = time.monotonic()
        outcome = spawn_impl(impl, big)
        ok = isinstance(outcome, list)
        print(f"{impl:6s} {'ok' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s", flush=True)
        measured[impl] = _one_step_summary(outcome) if isinstance(outcome, list) else {"failed": outcome}
    num_params = family.params(n_layer)
    estimates = {
        impl: asdict(family.estimate(num_params, world_size, strategy))
        for impl, strategy in (("ours", "FULL_SHARD"), ("ddp", "DDP"))
    }
    payload = {
        "kind": "largest",
        "args": asdict(args),
        "torch": torch.__version__,
        "source": source,
        "family": asdict(family),
        "budget_bytes": budget,
        "budget_source": budget_source,
        "at_budget": at_budget,
        "budget_scan": scan,
        "measured_n_layer": n_layer,
        "measured_params": num_params,
        "estimates": estimates,
        "measured": measured,
    }
    payload["report"] = [source_line(source), *largest_report(payload)]
    return payload


def largest_report(payload: dict[str, Any]) -> list[str]:
    """The --largest run as text: the estimator's answer, then the measured step against the budget."""
    budget, at, family = payload["budget_bytes"], payload["at_budget"], payload["family"]
    world_size = payload["args"]["world_size"]
    whole_layers = (family["root"] + at["full_shard_layers"] * family["block"]) / (
        family["root"] + at["ddp_layers"] * family["block"]
    )
    lines = [
        f"budget: {_mb(budget)} per rank = {payload['budget_source']}",
        f"estimator (lightning_fsdp.estimate, W={world_size}, fp32 AdamW; largest unit "
        f"{family.get('unit', family['block']) / 1e6:.2f}M params (wrap: {payload['args'].get('wrap', 'block')}), "
        f"layer {family['block'] / 1e6:.2f}M, root {family['root'] / 1e6:.2f}M):",
        f"  largest DDP         {at['ddp_params'] / 1e6:7.1f}M params ({at['ddp_layers']} whole layers)",
        f"  largest FULL_SHARD  {at['full_shard_params'] / 1e6:7.1f}M params ({at['full_shard_layers']} whole layers)",
        f"  ratio FULL_SHARD/DDP {at['ratio']:.2f} (in whole layers {whole_layers:.2f}); target >= 1.80",
        "  ratio at 1x 2x 4x 8x the budget: " + " ".join(f"{row['ratio']:.2f}" for row in payload["budget_scan"]),
        f"measured: one step of the {payload['measured_n_layer']}-layer model "
        f"({payload['measured_params'] / 1e6:.1f}M params), which the estimator fits in FULL_SHARD but not DDP:",
    ]
    measured, estimates = payload["measured"], payload["estimates"]
    impls = [impl for impl in ("ours", "ddp") if "failed" not in measured[impl]]
    for impl in ("ours", "ddp"):
        if impl not in impls:
            lines.append(f"WARNING: {impl} failed: {measured[impl]['failed'].strip()[-500:]}")
    rows: list[tuple[str, Callable[[str], int]]] = [
        ("params+grads+optim, measured", lambda i: measured[i]["state_bytes"]["total"]),
        (
            "params+grads+optim, estimator",
            lambda i: estimates[i]["params"] + estimates[i]["grads"] + estimates[i]["optimizer_state"],
        ),
        (
            "+ gathered units, estimator",
            lambda i: (
                estimates[i]["params"]
                + estimates[i]["grads"]
                + estimates[i]["optimizer_state"]
                + estimates[i]["unsharded_working_set"]
            ),
        ),
        ("all tensors but data, step start", lambda i: measured[i]["step_start_tensor_bytes"]),
        ("all tensors but data, step peak", lambda i: measured[i]["step_peak_tensor_bytes"]),
    ]
    lines.append(f"{'':40s}" + "".join(f"{impl:>14s}" for impl in impls) + f"{'/ budget':>14s}")
    for title, value in rows:
        cells = "".join(f"{_mb(value(i)):>14s}" for i in impls)
        fractions = " ".join(f"{value(i) / budget:.2f}" for i in impls)
        lines.append(f"{title:40s}{cells}{fractions:>14s}")
    if len(impls) == 2:
        ours, ddp = (measured[i]["state_bytes"]["total"] for i in impls)
        verdict = "fits" if ours <= budget else "does NOT fit"
        lines.append(
            f"ours/ddp params+grads+optim {ours / ddp:.2f}; ours {verdict} the budget, ddp needs {ddp / budget:.2f}x it"
        )
        curves = [measured[i]["loss_curve"] for i in impls]
        rtol = LOSS_RTOL[payload["args"]["precision"]]
        if any(abs(a - b) > rtol * abs(b) for a, b in zip(*curves, strict=True)):
            lines.append(f"WARNING: losses disagree beyond rtol {rtol:g}: ours {curves[0]} vs ddp {curves[1]}")
        else:
            lines.append(f"losses agree: {' '.join(f'{x:.5f}' for x in curves[0])}")
    return lines


# ------------------------------------------------------------------------------------------------- plotting

_COLORS = {"ours": "tab:blue", "fsdp2": "tab:orange", "ddp": "tab:green"}


def _label(impl: str, args: dict[str, Any]) -> str:
    if impl == "ours":
        return "ours" if args["sharding_strategy"] == "FULL_SHARD" else f"ours ({args['sharding_strategy']})"
    return impl


def _plot_step_time(ax: Any, comparison: dict[str, Any]) -> None:
    """Median step time per implementation, whiskers from the fastest to the slowest timed step."""
    ok = {impl: s for impl, s in comparison["summaries"].items() if s["ok"]}
    names = list(ok)
    medians = [ok[i]["step_time_median_s"] * 1e3 for i in names]
    low = [m - ok[i]["step_time_min_s"] * 1e3 for m, i in zip(medians, names, strict=True)]
    high = [ok[i]["step_time_max_s"] * 1e3 - m for m, i in zip(medians, names, strict=True)]
    x = range(len(names))
    ax.bar(x, medians, color=[_COLORS[i] for i in names], yerr=[low, high], capsize=6, alpha=0.85)
    # Every timed step as a dot: on a shared machine the spread (bimodal, at times) says more than the bar.
    for xi, impl in zip(x, names, strict=True):
        steps = [
            max(ranks) * 1e3
            for round_ in comparison["raw"][impl]
            if isinstance(round_, list)
            for ranks in zip(*(r["step_times_s"] for r in round_), strict=True)
        ]
        offsets = [0.25 * (k / max(1, len(steps) - 1) - 0.5) for k in range(len(steps))]
        ax.plot([xi + o for o in offsets], steps, ".", color="black", markersize=4)
    for xi, median in zip(x, medians, strict=True):
        ax.annotate(f"{median:.0f}", (xi - 0.38, median), xytext=(0, 3), textcoords="offset points", fontsize=8)
    ax.set_xticks(list(x), [_label(i, comparison["args"]) for i in names])
    ax.set_ylabel("ms per step (slowest rank; dots: each timed step)")
    a = comparison["args"]
    ax.set_title(
        f"step time: median, min-max\nW={a['world_size']}, {a['threads']} thread/rank, {a['precision']}", fontsize=10
    )


def _plot_state_bytes(ax: Any, comparison: dict[str, Any]) -> None:
    """Per-rank parameters, gradients and optimizer state, stacked."""
    ok = {impl: s for impl, s in comparison["summaries"].items() if s["ok"]}
    names = list(ok)
    x = list(range(len(names)))
    bottom = [0.0] * len(names)
    for part, alpha, hatch in (("params", 1.0, ""), ("grads", 0.65, "//"), ("optim", 0.35, "..")):
        heights = [ok[i]["state_bytes"][part] / 2**20 for i in names]
        ax.bar(
            x,
            heights,
            bottom=bottom,
            color=[_COLORS[i] for i in names],
            alpha=alpha,
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
            label={"optim": "optimizer state"}.get(part, part),
        )
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for xi, total in zip(x, bottom, strict=True):
        ax.annotate(f"{total:.0f}", (xi, total), xytext=(-8, 3), textcoords="offset points", fontsize=8)
    ax.set_xticks(x, [_label(i, comparison["args"]) for i in names])
    ax.set_ylabel("MiB per rank")
    num_params = next(iter(ok.values()))["num_params"]
    ax.set_title(f"params + grads + optimizer state\n{num_params / 1e6:.1f}M params, AdamW", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def _plot_memory_vs_size(ax: Any, comparison: dict[str, Any] | None, largest: dict[str, Any] | None) -> None:
    """The estimator's per-rank bytes against model size, with every measured point of the runs on it."""
    source = comparison or largest
    assert source is not None
    args = BenchArgs(**{**source["args"], "impls": tuple(source["args"]["impls"])})
    family = model_family(args)
    world_size = args.world_size
    points = [ok["num_params"] for ok in (comparison or {}).get("summaries", {}).values() if ok["ok"]]
    if largest is not None:
        points += [largest["measured_params"], largest["at_budget"]["full_shard_params"]]
    x_max = 1.25 * max(points)
    xs = [x_max * k / 50 for k in range(1, 51)]
    for strategy, color, label in (("DDP", _COLORS["ddp"], "DDP"), ("FULL_SHARD", _COLORS["ours"], "FULL_SHARD")):
        estimates = [family.estimate(int(n), world_size, strategy) for n in xs]
        ax.plot(
            [n / 1e6 for n in xs], [e.peak / 2**20 for e in estimates], color=color, label=f"estimator peak, {label}"
        )
        if strategy == "FULL_SHARD":
            ax.plot(
                [n / 1e6 for n in xs],
                [e.steady / 2**20 for e in estimates],
                color=color,
                linestyle="--",
                linewidth=1,
                label="estimator params+grads+optim, FULL_SHARD",
            )
    markers = {"ours": "o", "fsdp2": "x", "ddp": "s"}
    for impl, s in (comparison or {}).get("summaries", {}).items():
        if s["ok"]:
            ax.plot(
                s["num_params"] / 1e6,
                s["state_bytes"]["total"] / 2**20,
                markers[impl],
                color=_COLORS[impl],
                markersize=7,
                label=f"measured params+grads+optim, {_label(impl, source['args'])}",
            )
    if largest is not None:
        budget = largest["budget_bytes"] / 2**20
        at = largest["at_budget"]
        ax.axhline(budget, color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"budget {budget:.0f} MiB", (0, budget), xytext=(3, 3), textcoords="offset points", fontsize=7)
        for impl in ("ours", "ddp"):
            m = largest["measured"][impl]
            if "failed" not in m:
                ax.plot(
                    m["num_params"] / 1e6,
                    m["state_bytes"]["total"] / 2**20,
                    markers[impl],
                    color=_COLORS[impl],
                    markerfacecolor="none",
                    markersize=9,
                    label=f"measured params+grads+optim, {impl}, --largest",
                )
        for n, color in ((at["ddp_params"], _COLORS["ddp"]), (at["full_shard_params"], _COLORS["ours"])):
            ax.axvline(n / 1e6, color=color, linestyle=":", linewidth=1)
        ax.annotate(
            f"{at['ratio']:.2f}x DDP's largest",
            (at["full_shard_params"] / 1e6, budget),
            xytext=(-4, 5),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            color=_COLORS["ours"],
        )
    ax.set_xlim(0, x_max / 1e6)
    ax.set_ylim(0, None)
    ax.set_xlabel(f"parameters (M), n_embd={args.n_embd}, depth varied")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"memory against model size, W={world_size}\n(activations not included)", fontsize=10)
    ax.legend(fontsize=6, loc="upper left")


def plot_results(payloads: list[dict[str, Any]], path: str) -> None:
    """Draw a comparison payload and/or a --largest payload into one PNG (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comparison = next((p for p in payloads if p.get("kind") == "comparison"), None)
    largest = next((p for p in payloads if p.get("kind") == "largest"), None)
    if comparison is None and largest is None:
        raise SystemExit("nothing to plot: give a --json file of a comparison or of a --largest run")
    panels = 3 if comparison is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(4.8 * panels, 4.4), dpi=90, layout="constrained", squeeze=False)
    if comparison is not None:
        _plot_step_time(axes[0][0], comparison)
        _plot_state_bytes(axes[0][1], comparison)
    _plot_memory_vs_size(axes[0][-1], comparison, largest)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


# --------------------------------------------------------------------------------------------------- main


def run_comparison(args: BenchArgs) -> dict[str, Any] | None:
    """The three implementations, interleaved; the payload (None on a torchrun rank other than 0)."""
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if under_torchrun:
        args = replace(args, world_size=int(os.environ["WORLD_SIZE"]))
    source = source_state()
    impls, skipped = available_impls(args)
    is_rank0 = not under_torchrun or os.environ.get("RANK", "0") == "0"
    if is_rank0:
        for impl, why in skipped.items():
            print(f"WARNING: skipping {impl}: {why}", flush=True)
    if not impls:
        raise SystemExit("no implementation to run")
    results = run_all_torchrun(args, impls) if under_torchrun else run_all_spawned(args, impls)
    if results is None:  # a torchrun rank other than 0
        return None
    summaries = {impl: summarize(impl, rounds, args) for impl, rounds in results.items()}
    return {
        "kind": "comparison",
        "args": asdict(args),
        "torch": torch.__version__,
        "source": source,
        "skipped": skipped,
        "rss_isolated": not under_torchrun,
        "summaries": summaries,
        "report": [source_line(source), *report(summaries, args, rss_isolated=not under_torchrun)],
        "raw": results,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        payloads = [json.loads(Path(path).read_text()) for path in args.from_json]
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
        if args.largest:
            if "TORCHELASTIC_RUN_ID" in os.environ:
                raise SystemExit("--largest spawns its own ranks; run it without torchrun")
            payload = run_largest(args)
        else:
            payload = run_comparison(args)
        if payload is None:
            return
        payloads = [payload]
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(payload, indent=1))
    for payload in payloads:
        print("\n".join(payload["report"]), flush=True)
    if args.json and not args.from_json:
        print(f"wrote {args.json}")
    if args.plot:
        plot_results(payloads, args.plot)


if __name__ == "__main__":
    main()
