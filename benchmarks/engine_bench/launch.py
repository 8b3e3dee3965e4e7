"""Running rounds: each (round, implementation) in fresh ranks, or all of them inside torchrun's."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import inspect
import json
import os
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline
from lightning_fsdp.runtime.process_exit import exit_now

from .config import SHARED_MEMORY_SWITCH, BenchArgs
from .measure import run_impl


def _prepare_rank(args: BenchArgs) -> None:
    """Threads, and the imports every implementation's process pays for, so RSS baselines are comparable."""
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's deprecated collective names
    importlib.import_module("torch.distributed.fsdp")
    with contextlib.suppress(ImportError):
        importlib.import_module("lightning_fsdp")
    # Read by the engine when it picks its transport; set in every implementation's ranks alike.
    os.environ[SHARED_MEMORY_SWITCH] = "1" if args.transport == "shm" else "0"


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
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py


def spawn_impl(impl: str, args: BenchArgs) -> list[dict[str, Any]] | str:
    """Run one round of ``impl`` in fresh processes; the per-rank results, or why it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            spawn_with_deadline(_spawned_rank, args.world_size, (impl, args, free_port(), out), args.timeout)
        except (RuntimeError, TimeoutError) as err:
            return str(err)
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


Results = dict[str, list[list[dict[str, Any]] | str]]  # per implementation, per round: the ranks' numbers or why not


def run_all_spawned(configs: list[BenchArgs], impls: list[str]) -> list[Results]:
    """Every round runs every implementation under every config once (eager, then compiled with --compiled-row),
    in that order, each in its own processes; one result per config."""
    results: list[Results] = [{impl: [] for impl in impls} for _ in configs]
    rounds = configs[0].rounds
    for round_index in range(rounds):
        for config, config_results in zip(configs, results, strict=True):
            for impl in impls:
                name = impl if config.compile is None else f"{impl} compiled"
                start = time.monotonic()
                outcome = spawn_impl(impl, config)
                if isinstance(outcome, str):
                    # One retry: rare native crashes of gloo/the profiler on a loaded machine should not void a
                    # round; the failure is still printed and counted.
                    print(f"  {name} failed, retrying once: {outcome.strip()[-3000:]}", flush=True)
                    config_results[impl].append(outcome)
                    outcome = spawn_impl(impl, config)
                status = "ok" if isinstance(outcome, list) else "FAILED"
                print(
                    f"round {round_index + 1}/{rounds} {name:15s} {status} in {time.monotonic() - start:.1f} s",
                    flush=True,
                )
                if isinstance(outcome, str):
                    print(f"  {name} failed: {outcome.strip()[-3000:]}", flush=True)
                config_results[impl].append(outcome)
    return results


def run_all_torchrun(args: BenchArgs, impls: list[str]) -> Results | None:
    """The same rounds inside torchrun's processes (shared, so peak RSS is not isolated); rank 0 gets all."""
    _prepare_rank(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: Results = {impl: [] for impl in impls}
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
