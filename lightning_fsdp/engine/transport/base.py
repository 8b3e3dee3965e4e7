"""One interface for a unit's collectives, whatever moves the bytes: ``all_gather``, ``reduce_scatter`` and
``all_reduce``, each returning a ``Pending`` whose ``wait`` gives the same shape on every transport.

A root chooses one ``Transport`` per process group (see [Note: one transport per group] above ``Transport``). Each
transport owns the buffer pool of its temporaries (see [Note: why pool on CPU] in ``buffers.py``) and carries every
collective's ``Stamp`` with its data (see [Note: collective identity] in ``identity.py``). Collectives whose data
never reaches a ``torch.distributed`` op (shared memory) are announced to the hooks of ``add_collective_hook``, which
is how ``comm_stats.CollectiveCounter`` counts them: no call into the statistics in the hot path.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import torch
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.buffers import BufferPool
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.packing import RankRows

CHUNK_SWITCH = "LIGHTNING_FSDP_CHUNK_MIB"
DEFAULT_CHUNK_MIB = 8.0  # a few MiB: chunks large enough that a chunk's bookkeeping costs nothing beside its copies
# A shared-memory slot: smaller, because every rank's segment is resident in every rank of the host that reads it,
# while a chunk over gloo is a message whose fixed costs 8 MiB amortise (both measured: benchmarks/history.md).
SHARED_MEMORY_CHUNK_MIB = 4.0
PIPELINE = 2  # chunks of one collective in flight at once: one packed while the peers read the one before


def chunk_limit(default_mib: float = DEFAULT_CHUNK_MIB) -> int:
    """The most bytes a collective moves in one piece, in bytes (``LIGHTNING_FSDP_CHUNK_MIB``, else ``default_mib``):
    a shared-memory slot (see [Note: chunks] in ``shm/slots.py``), the largest buffer of a chunk over gloo (see
    [Note: chunks over gloo] in ``gloo.py``). A larger collective streams through in chunks, so a transport's memory
    does not grow with the largest unit."""
    text = os.environ.get(CHUNK_SWITCH, "")
    try:
        mib = float(text) if text else default_mib
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise ValueError(f"{CHUNK_SWITCH}={text!r} is not a positive number of MiB; set it to e.g. 8, or unset it.")
    return int(mib * 2**20)


Result = TypeVar("Result")
CollectiveHook = Callable[[str, str, torch.Tensor, int], None]  # (kind, op, payload, group size)
_COLLECTIVE_HOOKS: OrderedDict[int, CollectiveHook] = OrderedDict()  # RemovableHandle holds it by weak reference


def add_collective_hook(hook: CollectiveHook) -> RemovableHandle:
    """Call ``hook(kind, op, payload, group_size)`` for every collective whose data moves outside
    ``torch.distributed`` (a shared-memory all-gather, say), with the payload convention of the ``c10d`` op it
    replaces. Remove it with the returned handle."""
    handle = RemovableHandle(_COLLECTIVE_HOOKS)
    _COLLECTIVE_HOOKS[handle.id] = hook
    return handle


def announce(kind: str, op: str, payload: torch.Tensor, group_size: int) -> None:
    """Tell the collective hooks, if there are any, about a collective a transport moves by itself."""
    for hook in tuple(_COLLECTIVE_HOOKS.values()):
        hook(kind, op, payload, group_size)


def payload(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What an announced collective reports to the hooks when its data is not one tensor: its size, no memory."""
    return torch.empty(shape, dtype=dtype, device="meta")


_MESSAGES = threading.local()


@contextmanager
def messages_of_a_collective() -> Iterator[None]:
    """The point-to-point messages a transport sends and receives inside here make up one collective it announces,
    so ``CollectiveCounter`` counts that one and not them."""
    _MESSAGES.inside = True
    try:
        yield
    finally:
        _MESSAGES.inside = False


def inside_a_collective() -> bool:
    """Whether this thread is issuing the messages of an announced collective (``messages_of_a_collective``)."""
    return getattr(_MESSAGES, "inside", False)


class Pending(Generic[Result]):
    """One collective in flight. ``wait`` blocks until its result is usable on this rank and returns it (again on a
    second call); ``release`` says the caller is done with that result, so the transport may reuse its memory."""

    __slots__ = ("_finish", "_release", "_result")

    def __init__(self, finish: Callable[[], Result], release: Callable[[], None] | None = None) -> None:
        self._finish: Callable[[], Result] | None = finish
        self._release = release
        self._result: Result | None = None

    @staticmethod
    def done(result: Result, release: Callable[[], None] | None = None) -> Pending[Result]:
        """A collective that completed at once (one rank: nothing to exchange)."""
        return Pending(lambda: result, release)

    def wait(self) -> Result:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result  # type: ignore[return-value]

    def release(self) -> None:
        self.wait()
        if self._release is not None:
            release, self._release = self._release, None
            release()


# [Note: one transport per group] A root chooses, at its lazy init and on every rank alike, one transport for each
# process group its units use (``choose_transport``) and logs once which one and why no faster one was available:
#
# - ``SharedMemoryTransport`` (``shm/``): CPU ranks of one host; the data goes through shared memory and gloo only
#   synchronises. The fastest on one host.
# - ``GlooTransport`` (``gloo.py``): CPU ranks anywhere (between hosts, or with shared memory switched off).
# - ``NcclTransport`` (``nccl.py``): CUDA ranks; its own all-gather and reduce-scatter streams, ordered by events.
#
# What a collective's ``wait`` returns:
#
# - ``all_gather(shards)``: one 1-D block per rank of the group, in group rank order: the packed shards that rank sent.
#   Valid until ``release``, which gives the memory back to the transport.
# - ``reduce_scatter(grads)``: this rank's row of the sum over ranks, a 1-D tensor of its own (it becomes ``.grad``).
# - ``all_reduce(grads)``: the sum over ranks of the packed tensors, a 1-D tensor of its own.
class Transport(ABC):
    """The collectives of the units of one root over one process group (``None``: one rank, nothing exchanged).

    Every method packs the caller's tensors (casting to ``dtype``) into the transport's own send buffer and starts
    the collective; ``stamp`` travels with the data (None: no root numbers the collectives). ``divide_by`` divides
    the packed gradients before they are summed (low precision averages first so the sum cannot overflow).
    """

    name = "one rank"
    # Whether a collective is done once its call returns or soon after, on the training thread (shared memory, one
    # rank): then a stage that depends on it (HYBRID's sum across replicas) starts at once instead of at the wait.
    synchronous = False
    # The group's ranks on each of its hosts when its collectives run in two stages, inside each host and between
    # hosts (``hierarchical.py``); None otherwise. Only such a transport can keep a unit resharded to the host.
    ranks_per_host: int | None = None
    # Whether some of its collectives' bytes cross a link between hosts: then waits are long and the units keep
    # more gathers and reductions in flight (see [Note: the link's queue] in runtime/root.py).
    crosses_hosts = False
    # Whether it gathers single rows of a parameter (``gather_rows``): see [Note: an embedding's rows as they are
    # looked up] in ``embedding_rows.py``.
    gathers_rows = False

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.world_size = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        self.pool = BufferPool()

    @property
    def resident_bytes(self) -> int:
        """Memory this transport holds outside tensors the garbage collector sees (shared-memory segments)."""
        return 0

    def end_step(self) -> None:
        """The end of a backward: give the pooled temporaries back, so between steps a rank holds its shards only."""
        self.pool.clear()

    def close(self) -> None:
        """The end of the run (see [Note: what a run gives back] in ``engine/state/release.py``): give back every buffer
        and whatever the transport holds outside the garbage collector's view. It is not used again; a later forward
        of its root chooses a new one."""
        self.pool.clear_all()

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is this transport's own (a shard at home): it goes when the transport closes."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"

    @property
    def keeps_shards_at_home(self) -> bool:
        """Whether units keep their shards in this transport's memory (``home_for_shards``)."""
        return False

    def home_for_shards(self, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Memory for a unit to keep its shards of ``numels`` elements in (one tensor a shard), so that gathering them
        packs nothing; None where the transport has none (see [Note: shards that live in shared memory] in
        ``shm/homes.py``)."""
        return None

    # ----- the interface ------------------------------------------------------------------------------------------

    @abstractmethod
    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        """Every rank's packed ``shards`` (1-D tensors), one block per rank; see [Note: one transport per group]."""

    def all_gather_into(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """``all_gather``, then every rank's part of shard i into its row of ``dests[i]``, viewed as (world_size,
        shard i's numel): a unit's padded unsharded buffers. Its ``wait`` returns once they are filled; a transport
        that can fill them as the data arrives (chunks of shared memory) saves the gathered blocks' copy."""
        pending = self.all_gather(shards, dtype, stamp)

        def finish() -> None:
            packing.unpack_all_gather(pending.wait(), [shard.numel() for shard in shards], dests)
            pending.release()

        return Pending(finish)

    def all_gather_to_host(
        self,
        shards: list[torch.Tensor],
        dtype: torch.dtype,
        stamp: Stamp | None,
        dests: list[torch.Tensor],
        host_rows: list[torch.Tensor],
    ) -> Pending[None]:
        """``all_gather_into`` that also leaves in ``host_rows[i]`` the rows of shard i that every rank of this rank's
        column holds (one rank of each host): what ``gather_in_host`` gathers the full tensors from again, inside
        the host. See [Note: resharded to the host] in ``hierarchical.py``."""
        raise NotImplementedError(f"{self.name} collectives have no stage inside a host")

    def gather_in_host(
        self, host_rows: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """The full tensors into ``dests`` from the ``host_rows`` every rank of this host kept."""
        raise NotImplementedError(f"{self.name} collectives have no stage inside a host")

    @abstractmethod
    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        """This rank's row of the sum over ranks of ``grads`` packed side by side (their zero-padded
        (world_size, columns) views; see ``packing.RankRows``)."""

    @abstractmethod
    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        """The sum over ranks of the packed 1-D ``grads``."""

    def divides_exactly(self, divisor: int, grads: list[RankRows], dtype: torch.dtype) -> bool:
        """Whether ``reduce_scatter(grads, dtype, divide_by=divisor)`` divides at no cost of its own, to the same
        bits as dividing the sum: then an fp32 average is divided there rather than in a pass over the result."""
        return False
