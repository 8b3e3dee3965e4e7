"""The data of a unit's collectives through shared memory, between the CPU ranks of one host; gloo only synchronises.

[Note: why shared memory on CPU] Over gloo, ranks on one host talk through loopback TCP: every byte is copied into
the kernel and out again on the CPU cores the ranks compute on. Measured on the 2-core benchmark machine, an
all-gather of 5.4 MiB per rank (one block of the 25M-parameter demo GPT) takes ~5 ms of CPU time on each rank,
whether it overlaps compute or not, and a FULL_SHARD step issues 27 such collectives. Through shared memory the
same all-gather costs two copies the engine makes anyway (packing the shards, copying each parameter's rows out of
the gathered buffer) plus one small gloo barrier (~0.1 ms of CPU): each rank packs its send buffer straight into
its own shared segment and, after a barrier, every rank reads every other rank's segment. A reduce-scatter is the
same with a sum: each rank packs its (world_size, shard) gradient buffer into its segment and sums row ``rank`` of
every segment. This is what DeepSpeed's shared-memory all-reduce does for CPU ranks; NCCL does it on one node too.

[Note: slots] Each rank's segment is cut into ``SLOTS`` equal slots, one per collective in flight. A collective
takes the free slot that has been free the longest: every rank issues and finishes the engine's collectives in the
same order, so every rank takes the same slot, which is how readers know where to look. A slot is free again once
this rank has read the data of its collective (``release``), and is written again only after a second barrier,
issued at release, says that every other rank has read it too. Taking the longest-free slot rather than the lowest
gives that barrier time to complete: reusing the slot just released made every rank wait for the slowest reader,
~10 ms a step of the benchmark model. When every slot is taken, the collective runs over gloo instead (every rank
sees the same busy slots, so all of them do); a training step keeps at most four in flight (two gathers, two
reductions).

Barriers are gloo collectives, so a rank that dies makes the others fail with gloo's timeout rather than hang.
Each slot starts with a header holding the identity of the collective written there (see [Note: collective
identity] in ``ledger.py``): a rank that entered another collective is named at once instead of read.
Set ``LIGHTNING_FSDP_SHARED_MEMORY=0`` to keep everything on gloo.

[Note: segment lifetime] A segment is an anonymous memory file (``memfd_create``), never a file in ``/dev/shm``:
other ranks open it through ``/proc/<pid>/fd/<fd>`` of its creator, and the creator closes that descriptor as soon
as every rank has mapped it. The memory then lives exactly as long as the processes that map it, and a rank killed
at any moment -- before the others mapped its segment included -- leaves nothing behind for anyone to clean up. It
is allocated in full when it is created (``SLOTS`` x the largest unit's send buffer: 48 MiB a rank for the
25M-parameter benchmark model), so running out of memory is a refusal at creation (every rank falls back to gloo),
not a SIGBUS mid-training.
"""

from __future__ import annotations

import os
import uuid
from collections import deque

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.comm_stats import record_collective
from lightning_fsdp.engine.ledger import STAMP_NUMEL, Stamp

ENV_SWITCH = "LIGHTNING_FSDP_SHARED_MEMORY"
SEGMENT_NAME = "lightning_fsdp"  # how the segments show in /proc/<pid>/maps: "/memfd:lightning_fsdp-<pid> (deleted)"
SLOTS = 4
_ALIGN = 64  # bytes: keeps every slot aligned for vectorised copies of any dtype
HEADER_BYTES = _ALIGN  # the identity of the collective in the slot (see [Note: collective identity] in ledger.py)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _reserve(nbytes: int) -> int | None:
    """A new anonymous memory file with all its memory allocated now (its descriptor); None if that fails.

    A sparse file would take its pages only as collectives first write them: running out of memory then kills the
    process with SIGBUS in the middle of training. Allocating up front turns that into a refusal here, on the rank
    that ran out, before any rank depends on the transport. See [Note: segment lifetime].
    """
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:  # not Linux
        return None
    try:
        fd = memfd_create(f"{SEGMENT_NAME}-{os.getpid()}", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        return None
    return fd


def _map(path: str, nbytes: int) -> torch.Tensor:
    """The memory file at ``path`` (``/proc/<pid>/fd/<fd>``) mapped shared: writes are seen by every mapper.

    Never an inference tensor, though the first forward may run under Lightning's ``inference_mode`` (validation):
    training writes into these slots outside it, where an inference tensor accepts in-place writes only under
    ``no_grad``.
    """
    with torch.inference_mode(False):
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _stride(slot_bytes: int) -> int:
    """Bytes from one slot to the next: its header, then its data."""
    return HEADER_BYTES + slot_bytes


def _peer(path: str, nbytes: int, token: bytes) -> torch.Tensor | None:
    """Another rank's segment, if this rank sees the very memory that rank wrote its token to."""
    try:
        segment = _map(path, nbytes)
    except RuntimeError:  # another host, or another pid namespace: no such process here, or no access to it
        return None
    return segment if bytes(segment[: len(token)].tolist()) == token else None


class SharedMemoryTransport:
    """Every rank of ``group`` maps every other rank's segment of ``SLOTS`` slots, each a header and ``slot_bytes``."""

    def __init__(self, group: ProcessGroup, slot_bytes: int, segments: list[torch.Tensor]) -> None:
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.slot_bytes = slot_bytes  # the data a slot holds, after its header
        self.segments = segments  # uint8, one per rank of the group, in group rank order (this rank's own too)
        self._free = deque(range(SLOTS))  # free slots, the longest free first
        self._released: list[dist.Work | None] = [None] * SLOTS  # the barrier saying every rank has read the slot
        for slot in range(SLOTS):  # no collective in any slot yet (the first header held the creation token)
            self._header(self.rank, slot).fill_(-1)

    @property
    def resident_bytes(self) -> int:
        """This rank's memory in shared memory: its whole segment, allocated when the transport was created."""
        return SLOTS * _stride(self.slot_bytes)

    @staticmethod
    def create(group: ProcessGroup | None, slot_bytes: int) -> SharedMemoryTransport | None:
        """A collective over ``group``: the transport, or None where its ranks cannot share memory (on every rank).

        None for no group, a group of one rank or over another backend than gloo, when it is switched off or
        memory lacks room for every rank's segment, and for ranks that do not see each other's segments (other
        hosts, other pid namespaces): each rank checks a random token every other rank wrote.
        """
        if group is None or group.size() == 1 or dist.get_backend(group) != dist.Backend.GLOO or slot_bytes <= 0:
            return None
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        wanted = SLOTS * _stride(slot_bytes)
        token = uuid.uuid4().bytes
        fd = _reserve(wanted) if enabled() else None
        try:
            offers: list[tuple[str, bytes, bool] | None] = [None] * group.size()
            dist.all_gather_object(offers, (f"/proc/{os.getpid()}/fd/{fd}", token, fd is not None), group=group)
            if not all(ok for _, _, ok in offers):
                return None
            mine = _map(f"/proc/self/fd/{fd}", wanted)
            mine[: len(token)] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
            dist.barrier(group=group)  # every segment holds its token before anyone maps it
            segments = [
                mine if rank == group.rank() else _peer(path, wanted, expected)
                for rank, (path, expected, _) in enumerate(offers)
            ]
            agreed: list[bool | None] = [None] * group.size()
            dist.all_gather_object(agreed, all(s is not None for s in segments), group=group)  # all have mapped
        finally:
            if fd is not None:  # see [Note: segment lifetime]
                os.close(fd)
        if not all(agreed):
            return None
        return SharedMemoryTransport(group, slot_bytes, segments)

    # ----- slots -------------------------------------------------------------------------------------------------

    def acquire(self, nbytes: int) -> int | None:
        """The slot for the next collective, or None: it does not fit, or every slot is in flight (use gloo)."""
        if nbytes > self.slot_bytes or not self._free:
            return None
        slot = self._free.popleft()
        released = self._released[slot]
        if released is not None:  # everyone must have read what this slot held before we overwrite it
            released.wait()
            self._released[slot] = None
        return slot

    def view(self, rank: int, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at the start of ``rank``'s ``slot`` (this rank's own: to write into)."""
        start = slot * _stride(self.slot_bytes) + HEADER_BYTES
        return self.segments[rank][start : start + numel * dtype.itemsize].view(dtype)

    def _header(self, rank: int, slot: int) -> torch.Tensor:
        start = slot * _stride(self.slot_bytes)
        return self.segments[rank][start : start + STAMP_NUMEL * 8].view(torch.int64)

    def stamp(self, slot: int, stamp: Stamp | None) -> None:
        """Write the identity of the collective this rank is about to publish in ``slot`` into its header."""
        if stamp is not None:
            self._header(self.rank, slot).copy_(stamp.as_tensor())

    def verify(self, slot: int, stamp: Stamp | None) -> None:
        """After the publishing barrier: every rank's header of ``slot`` must hold this rank's stamp."""
        if stamp is not None:
            stamp.verify(torch.stack([self._header(rank, slot) for rank in range(self.world_size)]), self.group)

    def publish(self) -> dist.Work:
        """After writing this rank's slot: the barrier that, once complete, says every rank has written its own."""
        return dist.barrier(group=self.group, async_op=True)

    def release(self, slot: int) -> None:
        """This rank has read what it needed from every rank's ``slot``; the slot is written again after all have."""
        self._released[slot] = dist.barrier(group=self.group, async_op=True)
        self._free.append(slot)


class PendingSharedGather:
    """An all-gather through ``slot``: ``wait`` returns every rank's packed shards, one 1-D view per rank."""

    def __init__(
        self, transport: SharedMemoryTransport, slot: int, send: torch.Tensor, stamp: Stamp | None = None
    ) -> None:
        self.transport, self.slot, self.numel, self.dtype, self.stamp = transport, slot, send.numel(), send.dtype, stamp
        transport.stamp(slot, stamp)
        self.written: dist.Work | None = transport.publish()

    def wait(self) -> list[torch.Tensor]:
        if self.written is not None:
            self.written.wait()
            self.written = None
            self.transport.verify(self.slot, self.stamp)
        transport = self.transport
        return [transport.view(rank, self.slot, self.numel, self.dtype) for rank in range(transport.world_size)]

    def release(self) -> None:
        self.wait()
        self.transport.release(self.slot)


def send_buffer(
    transport: SharedMemoryTransport | None, numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor, int] | None:
    """This rank's slot as the send buffer of the next collective, with the slot number; None to use gloo."""
    if transport is None:
        return None
    slot = transport.acquire(numel * dtype.itemsize)
    if slot is None:
        return None
    return transport.view(transport.rank, slot, numel, dtype), slot


def all_gather(
    transport: SharedMemoryTransport, slot: int, send: torch.Tensor, stamp: Stamp | None = None
) -> PendingSharedGather:
    """Start the all-gather of ``send`` (already written into this rank's ``slot``), identified by ``stamp``."""
    record_collective("all_gather", "shm::all_gather", send, transport.world_size)
    return PendingSharedGather(transport, slot, send, stamp)


def reduce_scatter(
    transport: SharedMemoryTransport, slot: int, send: torch.Tensor, stamp: Stamp | None = None
) -> PendingSharedReduceScatter:
    """Start the reduce-scatter of the (world_size, shard) ``send`` (already written into this rank's ``slot``)."""
    record_collective("reduce_scatter", "shm::reduce_scatter", send, transport.world_size)
    return PendingSharedReduceScatter(transport, slot, send, stamp)


class PendingSharedReduceScatter:
    """A reduce-scatter through ``slot``; ``wait`` returns the sum over ranks of row ``rank``, in a new tensor."""

    def __init__(
        self, transport: SharedMemoryTransport, slot: int, send: torch.Tensor, stamp: Stamp | None = None
    ) -> None:
        self.transport, self.slot, self.columns, self.dtype = transport, slot, send.size(1), send.dtype
        self.stamp = stamp
        transport.stamp(slot, stamp)
        self.written: dist.Work | None = transport.publish()
        self.result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.result is None:
            assert self.written is not None
            self.written.wait()
            self.transport.verify(self.slot, self.stamp)
            transport, world_size = self.transport, self.transport.world_size
            numel = world_size * self.columns
            rows = [
                transport.view(rank, self.slot, numel, self.dtype).view(world_size, -1)[transport.rank]
                for rank in range(world_size)
            ]
            self.result = sum_rows(rows)  # never aliases the slot: it becomes the parameters' .grad
            transport.release(self.slot)
        return self.result


def sum_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of equal-sized rows, into a new tensor (pairwise adds stream; ``sum(dim=0)`` strides)."""
    if len(rows) == 1:
        return rows[0].clone()
    result = torch.add(rows[0], rows[1])
    for row in rows[2:]:
        result.add_(row)
    return result
