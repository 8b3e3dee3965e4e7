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

[Note: slots] Each rank's segment is cut into slots, one per collective in flight, in two sets sized by what each
collective sends (``SLOTS``): all-gathers send a unit's shard, reductions (reduce-scatters: W shards of gradients;
all-reduces: the whole gradient) much more. A collective takes the free slot of its set that has been free the
longest: every rank issues and finishes the engine's collectives in the
same order, so every rank takes the same slot, which is how readers know where to look. A slot is free again once
this rank has read the data of its collective (``release``), and is written again only after a second barrier,
issued at release, says that every other rank has read it too. Taking the longest-free slot rather than the lowest
gives that barrier time to complete: reusing the slot just released made every rank wait for the slowest reader,
~10 ms a step of the benchmark model. When every slot of its set is taken, or the collective is larger than a slot,
it runs over gloo instead (every rank sees the same busy slots, so all of them do); a training step keeps at most
two gathers and two reductions in flight, and ``summon_full_params`` more.

Barriers are gloo collectives, so a rank that dies makes the others fail with gloo's timeout rather than hang.
Each slot starts with a header holding the identity of the collective written there (see [Note: collective
identity] in ``ledger.py``): a rank that entered another collective is named at once instead of read.
Set ``LIGHTNING_FSDP_SHARED_MEMORY=0`` to keep everything on gloo.

[Note: segment lifetime] A segment is an anonymous memory file (``memfd_create``), never a file in ``/dev/shm``:
other ranks open it through ``/proc/<pid>/fd/<fd>`` of its creator, and the creator closes that descriptor as soon
as every rank has mapped it. The memory then lives exactly as long as the processes that map it, and a rank killed
at any moment -- before the others mapped its segment included -- leaves nothing behind for anyone to clean up. It
is allocated in full when it is created (``SLOTS``: three of the largest unit's shard, two of its gradients), so
running out of memory is a refusal at creation (every rank falls back to gloo), not a SIGBUS mid-training.
"""

from __future__ import annotations

import os
import uuid
from collections import deque

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine import collectives
from lightning_fsdp.engine.gloo import GlooTransport
from lightning_fsdp.engine.ledger import STAMP_NUMEL, Stamp
from lightning_fsdp.engine.transport import Pending, Transport, announce

ENV_SWITCH = "LIGHTNING_FSDP_SHARED_MEMORY"
SEGMENT_NAME = "lightning_fsdp"  # how the segments show in /proc/<pid>/maps: "/memfd:lightning_fsdp-<pid> (deleted)"
SLOTS = {"all_gather": 3, "reduce": 2}  # slots per set: a gather in use, two prefetched; a reduction behind another


def slot_bytes(send_bytes: dict[str, int]) -> dict[str, int]:
    """The data each set's slots hold, from the largest send buffer of each collective kind (see [Note: slots])."""
    reduce = max(send_bytes.get("reduce_scatter", 0), send_bytes.get("all_reduce", 0))
    return {"all_gather": _aligned(send_bytes.get("all_gather", 0)), "reduce": _aligned(reduce)}


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


def _peer(path: str, nbytes: int, token: bytes) -> torch.Tensor | None:
    """Another rank's segment, if this rank sees the very memory that rank wrote its token to."""
    try:
        segment = _map(path, nbytes)
    except RuntimeError:  # another host, or another pid namespace: no such process here, or no access to it
        return None
    return segment if bytes(segment[: len(token)].tolist()) == token else None


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SlotSet:
    """``count`` slots of ``slot_bytes`` (each after a header) starting at byte ``offset`` of every segment.

    ``acquire`` and ``release`` are this rank's bookkeeping; see [Note: slots] for why every rank agrees on it.
    """

    def __init__(self, group: ProcessGroup, offset: int, count: int, slot_bytes: int) -> None:
        self.group = group
        self.offset = offset
        self.count = count
        self.slot_bytes = slot_bytes  # the data a slot holds, after its header
        self.stride = HEADER_BYTES + slot_bytes
        self._free = deque(range(count))  # free slots, the longest free first
        self._released: list[dist.Work | None] = [None] * count  # the barrier saying every rank has read the slot

    @property
    def nbytes(self) -> int:
        return self.count * self.stride

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

    def release(self, slot: int) -> None:
        """This rank has read what it needed from every rank's ``slot``; the slot is written again after all have."""
        self._released[slot] = dist.barrier(group=self.group, async_op=True)
        self._free.append(slot)

    def start(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in a segment."""
        return self.offset + slot * self.stride


class SharedMemoryTransport(Transport):
    """Every rank of ``group`` maps every other rank's segment: a set of slots for all-gathers, one for reductions.

    A collective that finds no free slot of its size runs over ``fallback``, a gloo transport of the same group.
    """

    name = "shared memory"

    def __init__(self, group: ProcessGroup, send_bytes: dict[str, int], segments: list[torch.Tensor]) -> None:
        super().__init__(group)
        self.segments = segments  # uint8, one per rank of the group, in group rank order (this rank's own too)
        self.slots: dict[str, SlotSet] = {}
        offset = 0
        for kind, nbytes in slot_bytes(send_bytes).items():
            self.slots[kind] = SlotSet(group, offset, SLOTS[kind], nbytes)
            offset += self.slots[kind].nbytes
        self.fallback = GlooTransport(group)
        for slots in self.slots.values():  # no collective in any slot yet (the first header held the creation token)
            for slot in range(slots.count):
                self._header(slots, self.rank, slot).fill_(-1)

    @staticmethod
    def segment_bytes(send_bytes: dict[str, int]) -> int:
        return sum(SLOTS[kind] * (HEADER_BYTES + nbytes) for kind, nbytes in slot_bytes(send_bytes).items())

    @property
    def resident_bytes(self) -> int:
        """This rank's memory in shared memory: its whole segment, allocated when the transport was created."""
        return self.segments[self.rank].numel()

    def end_step(self) -> None:
        super().end_step()
        self.fallback.end_step()

    @staticmethod
    def create(group: ProcessGroup, send_bytes: dict[str, int]) -> tuple[SharedMemoryTransport | None, str]:
        """A collective over ``group``: the transport, or None and why its ranks cannot share memory (on every rank).

        None for a group over another backend than gloo, when it is switched off or memory lacks room for every
        rank's segment, and for ranks that do not see each other's segments (other hosts, other pid namespaces):
        each rank checks a random token every other rank wrote.
        """
        if dist.get_backend(group) != dist.Backend.GLOO:
            return None, f"shared memory needs a gloo group, not {dist.get_backend(group)}"
        wanted = SharedMemoryTransport.segment_bytes(send_bytes)
        token = uuid.uuid4().bytes
        fd = _reserve(wanted) if enabled() else None
        try:
            offers: list[tuple[str, bytes, bool] | None] = [None] * group.size()
            dist.all_gather_object(offers, (f"/proc/{os.getpid()}/fd/{fd}", token, fd is not None), group=group)
            if not all(ok for _, _, ok in offers):
                return None, (
                    f"shared memory is switched off ({ENV_SWITCH}=0) or has no room for a {wanted}-byte segment "
                    "on some rank"
                )
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
            return None, "some ranks cannot map the others' memory (other hosts or pid namespaces)"
        return SharedMemoryTransport(group, send_bytes, segments), "every rank maps every other rank's memory"

    # ----- slots -------------------------------------------------------------------------------------------------

    def view(self, slots: SlotSet, rank: int, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at the start of ``rank``'s ``slot`` (this rank's own: to write into)."""
        start = slots.start(slot) + HEADER_BYTES
        return self.segments[rank][start : start + numel * dtype.itemsize].view(dtype)

    def _header(self, slots: SlotSet, rank: int, slot: int) -> torch.Tensor:
        start = slots.start(slot)
        return self.segments[rank][start : start + STAMP_NUMEL * 8].view(torch.int64)

    def stamp(self, slots: SlotSet, slot: int, stamp: Stamp | None) -> None:
        """Write the identity of the collective this rank is about to publish in ``slot`` into its header."""
        if stamp is not None:
            self._header(slots, self.rank, slot).copy_(stamp.as_tensor())

    def verify(self, slots: SlotSet, slot: int, stamp: Stamp | None) -> None:
        """After the publishing barrier: every rank's header of ``slot`` must hold this rank's stamp."""
        if stamp is not None:
            headers = [self._header(slots, rank, slot) for rank in range(self.world_size)]
            stamp.verify(torch.stack(headers), self.group)

    def _publish(self, slots: SlotSet, slot: int, stamp: Stamp | None) -> dist.Work:
        """After writing this rank's slot: the barrier that, once complete, says every rank has written its own."""
        self.stamp(slots, slot, stamp)
        return dist.barrier(group=self.group, async_op=True)

    # ----- the collectives ---------------------------------------------------------------------------------------

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        numel = sum(shard.numel() for shard in shards)
        slots = self.slots["all_gather"]
        slot = slots.acquire(numel * dtype.itemsize)
        if slot is None:
            return self.fallback.all_gather(shards, dtype, stamp)
        send = self.view(slots, self.rank, slot, numel, dtype)
        collectives.pack([shard.reshape(-1) for shard in shards], send)
        announce("all_gather", "shm::all_gather", send, self.world_size)
        written = self._publish(slots, slot, stamp)

        def finish() -> list[torch.Tensor]:
            written.wait()
            self.verify(slots, slot, stamp)
            return [self.view(slots, rank, slot, numel, dtype) for rank in range(self.world_size)]

        return Pending(finish, lambda: slots.release(slot))

    def reduce_scatter(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        world_size, columns = self.world_size, sum(grad.size(1) for grad in grads)
        slots = self.slots["reduce"]
        slot = slots.acquire(world_size * columns * dtype.itemsize)
        if slot is None:
            return self.fallback.reduce_scatter(grads, dtype, stamp, divide_by)
        send = self.view(slots, self.rank, slot, world_size * columns, dtype).view(world_size, columns)
        collectives.pack(grads, send)
        if divide_by is not None:
            send.div_(divide_by)
        announce("reduce_scatter", "shm::reduce_scatter", send, world_size)
        written = self._publish(slots, slot, stamp)

        def finish() -> torch.Tensor:
            written.wait()
            self.verify(slots, slot, stamp)
            rows = [
                self.view(slots, rank, slot, world_size * columns, dtype).view(world_size, columns)[self.rank]
                for rank in range(world_size)
            ]
            result = collectives.sum_rows(rows)  # never aliases the slot: it becomes the parameters' .grad
            slots.release(slot)
            return result

        return Pending(finish)

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        slots = self.slots["reduce"]
        slot = slots.acquire(numel * dtype.itemsize)
        if slot is None:
            return self.fallback.all_reduce(grads, dtype, stamp, divide_by)
        send = self.view(slots, self.rank, slot, numel, dtype)
        collectives.pack(grads, send)
        if divide_by is not None:
            send.div_(divide_by)
        announce("all_reduce", "shm::all_reduce", send, self.world_size)
        written = self._publish(slots, slot, stamp)

        def finish() -> torch.Tensor:
            written.wait()
            self.verify(slots, slot, stamp)
            result = collectives.sum_rows([self.view(slots, r, slot, numel, dtype) for r in range(self.world_size)])
            slots.release(slot)
            return result

        return Pending(finish)
