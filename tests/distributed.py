"""The one helper for multi-process tests: run a function on ``world_size`` gloo ranks and fail loudly.

Every distributed test goes through :func:`run_distributed` so that all of them share the same guarantees:
a rank that raises fails the test at once with that rank's traceback (the other ranks are terminated rather
than left waiting in a collective), a hang fails after ``timeout`` seconds instead of eating CI's budget,
and no rank outlives the call.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from lightning_fsdp.process_exit import exit_now

__all__ = ["run_distributed"]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes joined in a gloo group.

    ``fn`` and ``args`` must be picklable, so ``fn`` is a module-level function. ``timeout`` bounds the whole
    run (start-up included) and is also the process group's collective timeout.

    Raises:
        RuntimeError: a rank raised or died; the message names every failed rank, with its traceback.
        TimeoutError: some rank had not finished after ``timeout`` seconds; all ranks were killed.
    """
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(f"run_distributed needs a module-level function and picklable args: {err}") from None
    context = mp.start_processes(
        _run_rank,
        args=(fn, world_size, _free_port(), timeout, args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
                raise TimeoutError(
                    f"ranks {running} did not finish within {timeout:g} s: probably a hang (a collective that "
                    "not every rank entered, or a deadlock); all ranks were killed"
                )
    except ProcessException as err:
        # By now join() has ended every rank. The rank it names is only the first one it noticed: when one
        # rank raises, its peers' collectives fail a moment later ("Connection reset by peer"), so report all.
        raise RuntimeError(_failure_report(context) or err.msg) from None
    finally:
        _kill_and_clean_up(context)


def _run_rank(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout: float, args: tuple) -> None:
    # A rank killed by a crash (SIGSEGV, SIGABRT) leaves no traceback file; this prints its Python stack to
    # the test's captured stderr instead.
    faulthandler.enable()
    # The ranks share the machine's cores; one thread each keeps them from oversubscribing it. The variable
    # is for libraries loaded later (OpenBLAS reads it at load time); torch is already loaded here.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    fn(rank, world_size, *args)
    # Only on success: a failing rank exits at once, and its exit closes the group's connections anyway.
    dist.destroy_process_group()
    exit_now()  # see [Note: gloo exit race] in lightning_fsdp/process_exit.py


def _failure_report(context: mp.ProcessContext) -> str:
    """Every failed rank, the likely cause first: ranks that died (a crash or a kill leaves no traceback, and
    its peers' errors are consequences), then ranks that raised, in the order they wrote their tracebacks."""
    world_size = len(context.processes)
    failures: list[tuple[int, str]] = []
    for rank, (process, error_file) in enumerate(zip(context.processes, context.error_files, strict=True)):
        traceback = _read_traceback(error_file)
        if traceback is not None:
            failures.append((os.stat(error_file).st_mtime_ns, f"rank {rank} of {world_size} raised:\n{traceback}"))
        elif process.exitcode is not None and process.exitcode < 0 and process.exitcode != -signal.SIGTERM:
            # SIGTERM is left out: it is how join() stops the ranks that were still running.
            name = signal.Signals(-process.exitcode).name
            failures.append((-1, f"rank {rank} of {world_size} died: killed by signal {name}"))
        elif process.exitcode is not None and process.exitcode > 0:
            failures.append((-1, f"rank {rank} of {world_size} died: exited with code {process.exitcode}"))
    return "\n\n".join(message for _, message in sorted(failures, key=lambda failure: failure[0]))


def _read_traceback(error_file: str) -> str | None:
    # A rank that join() terminated while it was writing its traceback leaves an empty or torn file.
    try:
        with open(error_file, "rb") as file:
            return pickle.load(file)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _free_port() -> int:
    # The OS picks a port that is free now; rank 0's store binds it a moment later. The window for another
    # process to take it in between is small enough for tests.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kill_and_clean_up(context: mp.ProcessContext) -> None:
    # Runs on every exit path, the test's own failure and pytest-timeout's interruption included.
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()
    # torch leaves the traceback files of failed ranks behind in the temp directory.
    for error_file in context.error_files:
        if os.path.exists(error_file):
            os.remove(error_file)
