"""Waiting on the other ranks of one host by reading counters they write into shared memory.

A rank publishes by a plain store of a counter after its data, and a waiting rank reads its peers' counters: no
message, nothing asked of the rank waited on (see [Note: counters instead of barriers] above ``ORDERED_STORES``). A
wait yields, then sleeps, and never waits forever: it names a peer that has exited and raises after the timeout.
"""

from __future__ import annotations

import ctypes
import platform
import time
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.diagnostics.hang_watch import Waiting, failure_of

# [Note: counters instead of barriers] A gloo barrier is a message through loopback TCP handled by a gloo thread, and on
# a machine whose cores all compute (as many ranks as cores) that thread waits for a time slice, so two barriers per
# collective (one to publish its data, one to say every rank has read it) would cost every collective that wait. Instead
# each rank writes, in its own segment, a counter per slot saying which use of the slot it has published and one saying
# which it has read (``transport.py``); a rank waiting on the others reads their counters, which costs nothing to the
# rank being waited on and is seen at once.
#
# A counter is a plain aligned 8-byte store written after the data it announces. On x86-64 stores become visible to
# other cores in program order (the non-temporal stores of large copies end with a fence) and loads are not reordered
# with older loads, so a rank that reads the counter reads the data written before it; other architectures need fences
# Python cannot issue, so the transport is only offered on x86-64 (``ORDERED_STORES``).
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")
YIELD_S = 1e-3  # wall time spent yielding between reads before sleeping between them
SLEEP_FRACTION = 0.05  # of the time waited so far
MAX_SLEEP_S = 2e-3
LIVENESS_EVERY_S = 0.5


class PeerExitedError(RuntimeError):
    """A rank this rank waits on through shared memory is gone."""


def int64_words(segment: torch.Tensor) -> ctypes.Array:
    """``segment`` (uint8, 8-byte aligned) as int64 words read and written by plain loads and stores."""
    return (ctypes.c_int64 * (segment.numel() // 8)).from_address(segment.data_ptr())


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(
    ready: Callable[[], bool],
    waiting_on: dict[int, int],
    what: str,
    timeout_s: float,
    where: Callable[[], Waiting] | None = None,
    group: ProcessGroup | None = None,
) -> None:
    """Return once ``ready()``; ``waiting_on`` maps each rank this may wait for (of ``group``) to its pid.

    The wait first yields its core between reads (the other rank is likely on its way), then sleeps between reads for
    ``SLEEP_FRACTION`` of the time it has waited so far (at most ``MAX_SLEEP_S``): it ends at most ~5% late, and a long
    wait (a checkpoint written by another rank) leaves the core to other work. It never waits forever: a rank that has
    exited (or is a zombie) is named within a second, and a wait longer than ``timeout_s`` raises.

    Raises ``PeerExitedError`` when one of them has exited, ``TimeoutError`` after ``timeout_s``, and, once the
    wait is long, what ``where()``'s checks raise: see [Note: every wait knows where its peers are] in
    ``hang_watch.py``.
    """
    if ready():
        return
    start = time.monotonic()
    next_check = start + LIVENESS_EVERY_S
    waiting: Waiting | None = None
    try:
        while not ready():
            now = time.monotonic()
            if now - start < YIELD_S:
                time.sleep(0)  # yields the core
                continue
            if now >= next_check:
                next_check = now + LIVENESS_EVERY_S
                _check_alive(waiting_on, what, group)
                if where is not None:
                    waiting = waiting or where()
                    waiting.tick()
                if now - start > timeout_s:
                    raise TimeoutError(
                        f"Timed out after {timeout_s:.0f} s waiting for ranks {sorted(waiting_on)} in {what}: they "
                        "are alive but never got there; every rank must run the same units in the same order (or "
                        "raise the process group's timeout)."
                    )
            time.sleep(min((now - start) * SLEEP_FRACTION, MAX_SLEEP_S))
    finally:
        if waiting is not None:
            waiting.done()


def _check_alive(waiting_on: dict[int, int], what: str, group: ProcessGroup | None) -> None:
    for rank, pid in waiting_on.items():
        if not process_alive(pid):
            said = failure_of(group, rank)
            if said:
                raise PeerExitedError(
                    f"rank {rank} (pid {pid}) exited while this rank waited for it in {what}; this rank stops too. "
                    f"It raised: {said}"
                )
            raise PeerExitedError(
                f"rank {rank} (pid {pid}) exited while this rank waited for it in {what}; this rank stops too. Its "
                "own error is in its log."
            )
