"""Starting local ranks for tests and benchmarks: a free port, and started processes under a deadline.

The test helper (``tests/distributed.py``) and the benchmarks (``benchmarks/``) launch ranks the same way, so they
share the same guarantees: a rank that raises or dies ends the run at once with every failed rank's traceback (the
others are killed rather than left waiting in a collective), a hang ends after ``timeout`` seconds instead of eating
the caller's budget, and no process outlives the call. Training under Lightning launches through its own launchers;
this module is for code that starts ranks itself.

[Note: ranks forked from a server] A freshly spawned interpreter spends seconds of CPU importing torch (and more for
Lightning) before a rank does any work, and a test suite starts hundreds of ranks. The ranks are therefore forked
from multiprocessing's fork server, a process that imported those modules once and never ran a torch op (so no
thread pool is lost in the fork). A forked rank would otherwise run in the server's state, not its launcher's: it
gets the launcher's environment and its stdout/stderr (under pytest, the current test's capture, where a crashed
rank's ``faulthandler`` stack belongs) sent along with its arguments, and applies them before anything else runs.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

__all__ = ["free_port", "spawn_with_deadline"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's store (``MASTER_PORT``).

    Rank 0's store binds it a moment later; the window for another process to take it in between is small
    enough for tests and benchmarks.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_with_deadline(
    fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...], timeout: float, preload: Sequence[str] = ()
) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes and wait at most ``timeout`` seconds.

    ``fn`` and ``args`` must be picklable, so ``fn`` is a module-level function. The processes are forked from a
    server that has imported torch, ``fn``'s module and the modules named in ``preload`` (see [Note: ranks forked
    from a server]); each rank runs in this process's current environment and writes to its stdout and stderr.
    The server starts at the first call and serves every later one, with the modules that call named: a module
    it lacks is imported by each rank that needs it.

    Raises:
        TypeError: ``fn`` or ``args`` cannot be pickled; nothing was started.
        RuntimeError: a rank raised or died; the message names every failed rank, with its traceback.
        TimeoutError: some rank had not finished after ``timeout`` seconds; all ranks were killed.
    """
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise TypeError(f"spawned ranks need a module-level function and picklable args: {err}") from None
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", fn.__module__, *preload])
    launcher = _LauncherState(dict(os.environ))
    context = mp.start_processes(
        _run_in_launcher_state, args=(launcher, fn, args), nprocs=nprocs, join=False, start_method="forkserver"
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


class _LauncherState:
    """What a rank forked from the server must take over from its launcher: the environment, stdout and stderr.

    Pickled into the rank's arguments, the streams travel as file descriptors: the rank gets duplicates of the
    launcher's descriptors 1 and 2, as a spawned child would inherit them.
    """

    def __init__(self, environment: dict[str, str]) -> None:
        self.environment = environment

    def __reduce__(self) -> tuple[Any, ...]:
        return _AdoptedLauncherState, (self.environment, reduction.DupFd(1), reduction.DupFd(2))


class _AdoptedLauncherState:
    """A :class:`_LauncherState` as the rank unpickles it, holding its own copies of the launcher's streams."""

    def __init__(self, environment: dict[str, str], out: Any, err: Any) -> None:
        self.environment = environment
        self.streams = (out.detach(), err.detach())

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environment)
        for target, fd in zip((1, 2), self.streams, strict=True):
            os.dup2(fd, target)
            os.close(fd)


def _run_in_launcher_state(
    rank: int, launcher: _AdoptedLauncherState, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """Run ``fn`` as the launcher would have; a ``sys.exit`` with an error status is reported like an exception.

    torch's rank wrapper writes the traceback of an ``Exception`` only: a rank leaving through ``SystemExit``
    (argparse, a library's fatal-error path) would otherwise be reported as "exited with code 1", with nothing
    to say where.
    """
    launcher.apply()
    try:
        fn(rank, *args)
    except SystemExit as exit_:
        if exit_.code in (None, 0):
            raise
        raise RuntimeError(f"rank {rank} called sys.exit({exit_.code!r})") from exit_


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


def _kill_and_clean_up(context: mp.ProcessContext) -> None:
    # Runs on every exit path, the caller's own failure and pytest-timeout's interruption included.
    for process in context.processes:
        if process.is_alive():
            process.kill()
        process.join()
    # torch leaves the traceback files of failed ranks behind in the temp directory.
    for error_file in context.error_files:
        if os.path.exists(error_file):
            os.remove(error_file)
