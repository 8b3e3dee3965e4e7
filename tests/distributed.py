"""The one helper for multi-process tests: run a function on ``world_size`` ranks in a process group and fail loudly.

Every distributed test goes through :func:`run_distributed` so that all of them share the same guarantees, which
:func:`lightning_fsdp.runtime.launch.spawn_with_deadline` gives (the benchmarks launch through it too): a rank that
raises fails the test at once with that rank's traceback (the other ranks are terminated rather than left waiting in a
collective), a hang fails after ``timeout`` seconds instead of eating CI's budget, and no rank outlives the call.
"""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_fsdp.runtime.launch import free_port, spawn_with_deadline
from lightning_fsdp.runtime.process_exit import exit_now

__all__ = ["run_distributed"]

# Imported once by the server the ranks are forked from (see [Note: ranks forked from a server] in
# lightning_fsdp/runtime/launch.py) instead of by every rank: the parity harness most tests use, and Lightning (which
# imports transformers) for the tests that train under a Trainer or Fabric inside the ranks.
_PRELOAD = ("tests.engine_harness", "lightning.pytorch")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, backend: str = "gloo"
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a ``backend`` group.

    ``fn`` and ``args`` must be picklable, so ``fn`` is a module-level function. ``timeout`` bounds the whole
    run (start-up included) and is also the process group's collective timeout. Under ``backend="nccl"`` rank
    ``r`` runs on CUDA device ``r`` (set as the current device before the group is created).

    Raises:
        RuntimeError: a rank raised or died; the message names every failed rank, with its traceback.
        TimeoutError: some rank had not finished after ``timeout`` seconds; all ranks were killed.
    """
    try:
        spawn_with_deadline(
            _run_rank, world_size, (fn, world_size, free_port(), timeout, backend, args), timeout, preload=_PRELOAD
        )
    except TypeError as err:
        raise TypeError(f"run_distributed: {err}") from None


def _run_rank(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout: float, backend: str, args: tuple
) -> None:
    # A rank killed by a crash (SIGSEGV, SIGABRT) leaves no traceback file; this prints its Python stack to
    # the test's captured stderr instead.
    faulthandler.enable()
    # The ranks share the machine's cores; one thread each keeps them from oversubscribing it. The variable
    # is for libraries loaded later (OpenBLAS reads it at load time); torch is already loaded here.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    fn(rank, world_size, *args)
    # Only on success: a failing rank exits at once, and its exit closes the group's connections anyway.
    dist.destroy_process_group()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/runtime/process_exit.py
