"""``SharedMemoryTransport``: the collectives of one process group's ranks on one host, through their segments.

Each rank packs what it sends into its own shared segment, and every rank reads every other rank's segment once that
rank's counter says the data is there: no message, no copy through the kernel (see [Note: why shared memory on CPU]
above ``SharedMemoryTransport``). A rank waiting on another notices within a second when that rank has exited, and
gives up after the process group's timeout: a dead rank never leaves the others hanging. Each slot starts with a
header holding the identity of the collective written there (see [Note: collective identity] in ``identity.py``): a
rank that entered another collective is named at once instead of read.
Set ``LIGHTNING_FSDP_SHARED_MEMORY=0`` to keep everything on gloo.
"""

from __future__ import annotations

import os
import uuid
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.diagnostics.hang_watch import Waiting, place_of
from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.base import PIPELINE, Pending, Transport, announce, payload
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.identity import STAMP_NUMEL, CollectiveMismatchError, Stamp
from lightning_fsdp.engine.transport.packing import RankRows
from lightning_fsdp.engine.transport.shm import segment
from lightning_fsdp.engine.transport.shm.homes import Homes, map_homes, too_many
from lightning_fsdp.engine.transport.shm.peer_wait import ORDERED_STORES, int64_words, wait_until
from lightning_fsdp.engine.transport.shm.slots import (
    HEADER_BYTES,
    LATEST,
    LATEST_STAMP,
    PUBLISHED,
    READ,
    SLOTS,
    SlotSet,
    slot_bytes,
)


# [Note: why shared memory on CPU] Over gloo, ranks on one host talk through loopback TCP: every byte is copied into the
# kernel and out again on the CPU cores the ranks compute on, for every collective, whether it overlaps compute or not.
# Through shared memory the same all-gather costs two copies the engine makes anyway (packing the shards, copying each
# parameter's rows out of the gathered buffer) and no message: each rank packs its send buffer straight into its own
# shared segment and, once every rank's counter says its data is there, every rank reads every other rank's segment. A
# reduce-scatter is the same with a sum: each rank packs the other ranks' rows of its (world_size, shard) gradient
# buffer into its segment and sums row ``rank`` of every other segment with its own row, read from the gradients
# themselves (see [Note: the own row stays in the gradient] in ``packing.py``). This is what DeepSpeed's shared-memory
# all-reduce does for CPU ranks; NCCL does it on one node too.
class SharedMemoryTransport(Transport):
    """Every rank of ``group`` maps every other rank's segment: a set of slots for all-gathers, one for reductions.

    A collective larger than a slot streams through the slots in chunks (see [Note: chunks]); one that finds no free
    slot runs over ``fallback``, a gloo transport of the same group.
    """

    name = "shared memory"
    synchronous = True

    def __init__(
        self,
        group: ProcessGroup,
        send_bytes: dict[str, int],
        segments: list[torch.Tensor],
        pids: list[int],
        shard_homes: tuple[tuple[int, ...], ...] = (),
        home_shards: list[list[torch.Tensor]] | None = None,
    ) -> None:
        super().__init__(group)
        self.segments = segments  # uint8, one per rank of the group, in group rank order (this rank's own too)
        self.words = [int64_words(mapped) for mapped in segments]
        self.peers = {rank: pid for rank, pid in enumerate(pids) if rank != self.rank}  # who a wait may wait on
        self.timeout_s = segment.timeout_of(group).total_seconds()
        self.sequence = 0  # uses of any slot so far: the same on every rank
        self.slots: dict[str, SlotSet] = {}
        offset = HEADER_BYTES  # after the rank's header
        for kind, nbytes in slot_bytes(send_bytes, self.world_size).items():
            self.slots[kind] = SlotSet(offset, SLOTS[kind], nbytes)
            offset += self.slots[kind].nbytes
        self.homes = Homes(offset, shard_homes)  # see [Note: shards that live in shared memory]
        self.home_shards = home_shards or []  # this rank's shards, each mapped once more as a storage of its own
        self._home_at = {shards[0].data_ptr(): home for home, shards in enumerate(self.home_shards) if shards}
        self._homed = {shard.data_ptr() for shards in self.home_shards for shard in shards}  # for ``holds``
        self.fallback = GlooTransport(group)
        self.words[self.rank][LATEST] = 0  # it held the creation token
        for slots in (*self.slots.values(), self.homes):  # no collective in any slot or home yet
            for slot in range(len(slots.last_use)):
                self._header(slots, self.rank, slot).fill_(-1)
                self._set(slots, slot, PUBLISHED, 0)
                self._set(slots, slot, READ, 0)
        dist.barrier(group=group)  # every header is cleared before any rank reads another's

    @staticmethod
    def homes_of(send_bytes: dict[str, int], world_size: int, shard_homes: tuple[tuple[int, ...], ...]) -> Homes:
        """Where the homes lie in a segment: after the rank's header and the slots."""
        slots = sum(
            SLOTS[kind] * (HEADER_BYTES + nbytes) for kind, nbytes in slot_bytes(send_bytes, world_size).items()
        )
        return Homes(HEADER_BYTES + slots, shard_homes)

    @staticmethod
    def segment_bytes(
        send_bytes: dict[str, int], world_size: int, shard_homes: tuple[tuple[int, ...], ...] = ()
    ) -> int:
        return SharedMemoryTransport.homes_of(send_bytes, world_size, shard_homes).end

    @property
    def resident_bytes(self) -> int:
        """This rank's memory in shared memory: its whole segment, allocated when the transport was created."""
        return self.segments[self.rank].numel()

    def close(self) -> None:
        """Drop every mapping this transport made: the segments (this rank's and its peers') and the homes, whose
        shards moved out before (``FSDPUnit.leave_run``). Each segment's memory goes back to the kernel once every
        rank has closed its transport (see [Note: segment lifetime])."""
        super().close()
        self.fallback.close()
        self.segments, self.words, self.home_shards, self._home_at, self._homed = [], [], [], {}, set()

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self._homed

    def end_step(self) -> None:
        """Also wait until every peer has read what this rank's homes published this step: the optimizer (or a
        checkpoint) may write them next (see [Note: shards that live in shared memory])."""
        super().end_step()
        self.fallback.end_step()
        what = "the end of a step (the other ranks reading this rank's shards)"
        for home, last_use in enumerate(self.homes.last_use):
            if last_use:
                self._await_peers(self.homes, home, READ, last_use, self.sequence + 1, None, what)

    @staticmethod
    def create(
        group: ProcessGroup, send_bytes: dict[str, int], shard_homes: tuple[tuple[int, ...], ...] = ()
    ) -> tuple[SharedMemoryTransport | None, str]:
        """A collective over ``group``: the transport, or None and why its ranks cannot share memory (on every rank).
        ``shard_homes``: the bytes of each shard of each unit whose shards will live in the segment, in the order the
        units claim their homes (see [Note: shards that live in shared memory]).

        None for a group over another backend than gloo, when it is switched off or memory lacks room for every
        rank's segment, and for ranks that do not see each other's segments (other hosts, other pid namespaces):
        each rank checks a random token every other rank wrote.
        """
        if dist.get_backend(group) != dist.Backend.GLOO:
            return None, f"shared memory needs a gloo group, not {dist.get_backend(group)}"
        if not ORDERED_STORES:  # every rank runs on the same machine type, or none shares memory with another
            return None, "shared memory needs x86-64's store ordering (see [Note: counters instead of barriers])"
        if too_many(shard_homes):  # the same on every rank
            shard_homes = ()
        wanted = SharedMemoryTransport.segment_bytes(send_bytes, group.size(), shard_homes)
        token = uuid.uuid4().bytes
        fd = segment.reserve(wanted) if segment.enabled() else None
        try:
            offers: list[tuple[str, bytes, bool] | None] = [None] * group.size()
            dist.all_gather_object(offers, (f"/proc/{os.getpid()}/fd/{fd}", token, fd is not None), group=group)
            if not all(ok for _, _, ok in offers):
                return None, (
                    f"shared memory is switched off ({segment.ENV_SWITCH}=0) or has no room for a {wanted}-byte "
                    "segment on some rank"
                )
            mine = segment.map_file(f"/proc/self/fd/{fd}", wanted)
            mine[: len(token)] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
            home_shards = map_homes(fd, SharedMemoryTransport.homes_of(send_bytes, group.size(), shard_homes))
            dist.barrier(group=group)  # every segment holds its token before anyone maps it
            segments = [
                mine if rank == group.rank() else segment.peer_segment(path, wanted, token_of_peer)
                for rank, (path, token_of_peer, _) in enumerate(offers)
            ]
            agreed: list[tuple[bool, bool] | None] = [None] * group.size()
            mapped = (all(s is not None for s in segments), home_shards is not None)
            dist.all_gather_object(agreed, mapped, group=group)  # all have mapped
        finally:
            if fd is not None:  # see [Note: segment lifetime]
                os.close(fd)
        if not all(segments_mapped for segments_mapped, _ in agreed):
            return None, "some ranks cannot map the others' memory (other hosts or pid namespaces)"
        if not all(homes_mapped for _, homes_mapped in agreed):  # every shard packs into the slots, as before homes
            shard_homes, home_shards = (), None
        pids = [int(path.split("/")[2]) for path, _, _ in offers]
        transport = SharedMemoryTransport(group, send_bytes, segments, pids, shard_homes, home_shards)
        return transport, "every rank maps every other rank's memory"

    # ----- slots -------------------------------------------------------------------------------------------------

    def view(self, slots: SlotSet, rank: int, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at the start of ``rank``'s ``slot`` (this rank's own: to write into)."""
        start = slots.start(slot) + HEADER_BYTES
        return self.segments[rank][start : start + numel * dtype.itemsize].view(dtype)

    def _header(self, slots: SlotSet, rank: int, slot: int) -> torch.Tensor:
        start = slots.start(slot)
        return self.segments[rank][start : start + STAMP_NUMEL * 8].view(torch.int64)

    def _set(self, slots: SlotSet, slot: int, counter: int, value: int) -> None:
        """Write one of this rank's counters of ``slot`` (``PUBLISHED`` or ``READ``)."""
        self.words[self.rank][slots.start(slot) // 8 + counter] = value

    def _await_peers(
        self, slots: SlotSet, slot: int, counter: int, value: int, sequence: int, stamp: Stamp | None, what: str
    ) -> None:
        """Wait until every other rank's ``counter`` of ``slot`` has reached ``value``, on the way to collective
        number ``sequence``: a rank that published that number while its counter lags is in another collective.

        [Note: a rank in another collective] A rank that published collective number ``sequence`` somewhere else
        (a reduction while this rank gathers, say) would never move the counter waited on: waiting would end only
        at the timeout. Each rank's header says the last number it published, written after its slot's counters and
        read here before them, so a rank whose header has reached ``sequence`` while the counter has not is in
        another collective, and is named at once. (Ranks in step never show that: a rank publishes number
        ``sequence`` only after the counters this rank waits on for it have moved.)
        """
        index = slots.start(slot) // 8 + counter

        def arrived() -> bool:
            done = True
            for rank in self.peers:
                words = self.words[rank]
                latest = words[LATEST]
                if words[index] >= value:
                    continue
                if latest >= sequence:
                    self._mismatch(rank, stamp)
                done = False
            return done

        where = lambda: Waiting(place_of(stamp, what), self.group)  # noqa: E731 -- built only for a long wait
        wait_until(arrived, self.peers, what, self.timeout_s, where, self.group)

    def _take(self, slots: SlotSet, nbytes: int, stamp: Stamp | None) -> tuple[int, int] | None:
        """A free slot for the next collective and the sequence number of this use; None: use gloo instead.

        The slot is written only once every rank has read its previous use.
        """
        slot = slots.acquire(nbytes)
        if slot is None:
            return None
        sequence = self.sequence + 1
        what = "a shared-memory collective (its slot's readers)"
        self._await_peers(slots, slot, READ, slots.last_use[slot], sequence, stamp, what)
        self.sequence = slots.last_use[slot] = sequence
        return slot, sequence

    def _release(self, slots: SlotSet, slot: int, sequence: int) -> None:
        """This rank has read every rank's data of this use of ``slot``."""
        self._set(slots, slot, READ, sequence)
        slots.release(slot)

    def stamp(self, slots: SlotSet, slot: int, stamp: Stamp | None) -> None:
        """Write the identity of the collective this rank is about to publish in ``slot`` into its header (plain
        stores, as the counters: a tensor op per chunk costs more than the check it serves)."""
        if stamp is not None:
            start = slots.start(slot) // 8
            self.words[self.rank][start : start + STAMP_NUMEL] = stamp.values()

    def verify(self, slots: SlotSet, slot: int, stamp: Stamp | None) -> None:
        """Once every rank has published ``slot``: every rank's header of it must hold this rank's stamp."""
        if stamp is not None:
            start = slots.start(slot) // 8
            stamp.verify([words[start : start + STAMP_NUMEL] for words in self.words], self.group)

    def _publish(self, slots: SlotSet, slot: int, sequence: int, stamp: Stamp | None) -> None:
        """After writing this rank's data into ``slot``: its identity, the counter that announces both, and then the
        rank's header (in this order: see [Note: a rank in another collective])."""
        self.stamp(slots, slot, stamp)
        self._set(slots, slot, PUBLISHED, sequence)
        words = self.words[self.rank]
        for i, value in enumerate(stamp.values() if stamp is not None else [-1] * STAMP_NUMEL):
            words[LATEST_STAMP + i] = value
        words[LATEST] = sequence

    def _await_published(self, slots: SlotSet, slot: int, sequence: int, stamp: Stamp | None) -> None:
        """Wait until every rank has published this use of ``slot``, and check they all ran the same collective."""
        what = "a shared-memory collective (its data)"
        self._await_peers(slots, slot, PUBLISHED, sequence, sequence, stamp, what)
        self.verify(slots, slot, stamp)

    def _mismatch(self, rank: int, stamp: Stamp | None) -> None:
        """``rank`` published this collective's number in another slot: raise, naming the collective it is in."""
        theirs = list(self.words[rank][LATEST_STAMP : LATEST_STAMP + STAMP_NUMEL])
        if stamp is None:
            raise CollectiveMismatchError(
                f"ranks entered different collectives: rank {rank} of the group is in another shared-memory "
                f"collective than rank {self.rank}."
            )
        stamps = torch.tensor([theirs if r == rank else stamp.values() for r in range(self.world_size)])
        stamp.verify(stamps, self.group)

    # ----- homes --------------------------------------------------------------------------------------------------

    @property
    def keeps_shards_at_home(self) -> bool:
        return bool(self.home_shards)

    def home_for_shards(self, numels: list[int], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The next home, for a unit's shards of ``numels`` elements of ``dtype``: one 1-D tensor a shard, each a
        storage of its own. None once every home planned at creation is claimed (a unit that came later gathers
        through the slots)."""
        homes = self.homes
        home = homes.claimed
        if home >= len(homes.shards) or homes.shards[home] != tuple(numel * dtype.itemsize for numel in numels):
            return None
        homes.claimed += 1
        return [shard.view(dtype) for shard in self.home_shards[home]]

    def _home_of(self, shards: list[torch.Tensor], dtype: torch.dtype) -> int | None:
        """The home whose shards ``shards`` are (in ``dtype``, in order); None where they are not a home's."""
        home = self._home_at.get(shards[0].data_ptr()) if shards and self._home_at else None
        if home is None or len(shards) != len(self.home_shards[home]):
            return None
        for shard, at_home in zip(shards, self.home_shards[home], strict=True):
            if shard.dtype != dtype or shard.data_ptr() != at_home.data_ptr() or shard.nbytes != at_home.nbytes:
                return None
        return home

    def _gather_at_home(
        self, home: int, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """See [Note: shards that live in shared memory]: publish the home as it is; the wait reads every rank's."""
        homes = self.homes
        numel = sum(shard.numel() for shard in shards)
        sequence = self.sequence + 1
        what = "a shared-memory gather (its home's readers)"
        self._await_peers(homes, home, READ, homes.last_use[home], sequence, stamp, what)
        self.sequence = homes.last_use[home] = sequence
        announce("all_gather", "shm::all_gather", payload((numel,), dtype), self.world_size)
        self._publish(homes, home, sequence, stamp)

        def finish() -> None:
            self._await_published(homes, home, sequence, stamp)
            sources, targets = [], []
            for rank in range(self.world_size):
                for index, (shard, dest) in enumerate(zip(shards, dests, strict=True)):
                    if rank == self.rank:
                        sources.append(shard)
                    else:
                        offset = homes.offsets[home][index]
                        sources.append(self.segments[rank][offset : offset + shard.nbytes].view(dtype))
                    targets.append(dest.view(self.world_size, -1)[rank])
            torch._foreach_copy_(targets, sources)
            self._set(homes, home, READ, sequence)

        return Pending(finish)

    # ----- the collectives ---------------------------------------------------------------------------------------

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        numel = sum(shard.numel() for shard in shards)
        slots = self.slots["all_gather"]
        if numel * dtype.itemsize > slots.slot_bytes:
            return self._all_gather_chunked([shard.reshape(-1) for shard in shards], numel, dtype, stamp)
        taken = self._take(slots, numel * dtype.itemsize, stamp)
        if taken is None:
            return self.fallback.all_gather(shards, dtype, stamp)
        slot, sequence = taken
        send = self.view(slots, self.rank, slot, numel, dtype)
        packing.pack([shard.reshape(-1) for shard in shards], send)
        announce("all_gather", "shm::all_gather", send, self.world_size)
        self._publish(slots, slot, sequence, stamp)

        def finish() -> list[torch.Tensor]:
            self._await_published(slots, slot, sequence, stamp)
            return [self.view(slots, rank, slot, numel, dtype) for rank in range(self.world_size)]

        return Pending(finish, lambda: self._release(slots, slot, sequence))

    def all_gather_into(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """A gather of shards at home packs nothing (see [Note: shards that live in shared memory]); one larger than a
        slot reads each chunk straight into ``dests`` (see [Note: chunks])."""
        home = self._home_of(shards, dtype)
        if home is not None:
            return self._gather_at_home(home, shards, dtype, stamp, dests)
        numel = sum(shard.numel() for shard in shards)
        slots = self.slots["all_gather"]
        if numel * dtype.itemsize <= slots.slot_bytes or not slots.has_free():
            return super().all_gather_into(shards, dtype, stamp, dests)
        flat = [shard.reshape(-1) for shard in shards]
        return self._gather_chunks(flat, dtype, stamp, [shard.numel() for shard in flat], dests)

    def _all_gather_chunked(
        self, shards: list[torch.Tensor], numel: int, dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        """An all-gather larger than a slot, chunk by chunk into blocks of the pool (see [Note: chunks])."""
        if not self.slots["all_gather"].has_free():
            return self.fallback.all_gather(shards, dtype, stamp)
        out = self.pool.take(self.world_size * numel, dtype, shards[0].device)
        pending = self._gather_chunks(shards, dtype, stamp, [numel], [out])

        def finish() -> list[torch.Tensor]:
            pending.wait()
            return list(out.view(self.world_size, numel).unbind(0))

        return Pending(finish, lambda: self.pool.give(out))

    def _gather_chunks(
        self,
        shards: list[torch.Tensor],
        dtype: torch.dtype,
        stamp: Stamp | None,
        shard_numels: list[int],
        dests: list[torch.Tensor],
    ) -> Pending[None]:
        """The packed 1-D ``shards`` of every rank, chunk by chunk, each rank's part of shard i copied into its row of
        ``dests[i]`` viewed as (world_size, ``shard_numels[i]``) (``packing.unpack_all_gather``'s layout)."""
        slots, numel = self.slots["all_gather"], sum(shard_numels)
        rows = [dest.view(self.world_size, -1) for dest in dests]

        def pack(slot: int, start: int, stop: int) -> None:
            packing.pack(shards, self.view(slots, self.rank, slot, stop - start, dtype), start)

        def read(slot: int, start: int, stop: int) -> None:
            for rank in range(self.world_size):
                chunk = self.view(slots, rank, slot, stop - start, dtype)
                packing.unpack_gathered_chunk(chunk, rank, start, shard_numels, rows)

        announce("all_gather", "shm::all_gather", payload((numel,), dtype), self.world_size)
        last = self._stream(slots, numel, slots.slot_bytes // dtype.itemsize, dtype.itemsize, pack, read, stamp)
        return Pending(last)

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        world_size, columns = self.world_size, sum(grad.columns for grad in grads)
        slots = self.slots["reduce"]
        own_row_in_grads = self.divides_exactly(divide_by or 1, grads, dtype)  # asked while a slot may be free
        if world_size * columns * dtype.itemsize > slots.slot_bytes:
            return self._reduce_scatter_chunked(grads, columns, dtype, stamp, divide_by, own_row_in_grads)
        taken = self._take(slots, world_size * columns * dtype.itemsize, stamp)
        if taken is None:
            return self.fallback.reduce_scatter(grads, dtype, stamp, divide_by)
        slot, sequence = taken
        send = self.view(slots, self.rank, slot, world_size * columns, dtype).view(world_size, columns)
        scale = 1.0 / (divide_by or 1)
        self._pack_rows(grads, send, 0, own_row_in_grads, scale, divide_by)
        announce("reduce_scatter", "shm::reduce_scatter", send, world_size)
        self._publish(slots, slot, sequence, stamp)

        def finish() -> torch.Tensor:
            self._await_published(slots, slot, sequence, stamp)
            result = torch.empty(columns, dtype=dtype, device=send.device)  # never the slot: it becomes .grad
            self._sum_own_rows(slots, slot, grads, result, 0, own_row_in_grads, scale)
            self._release(slots, slot, sequence)
            return result

        return Pending(finish)

    def _reduce_scatter_chunked(
        self,
        grads: list[RankRows],
        columns: int,
        dtype: torch.dtype,
        stamp: Stamp | None,
        divide_by: int | None,
        own_row_in_grads: bool,
    ) -> Pending[torch.Tensor]:
        """A reduce-scatter larger than a slot, a range of columns per chunk (see [Note: chunks])."""
        world_size, slots = self.world_size, self.slots["reduce"]
        if not slots.has_free():
            return self.fallback.reduce_scatter(grads, dtype, stamp, divide_by)
        result = torch.empty(columns, dtype=dtype, device=grads[0].flat.device)
        scale = 1.0 / (divide_by or 1)

        def pack(slot: int, start: int, stop: int) -> None:
            send = self.view(slots, self.rank, slot, world_size * (stop - start), dtype).view(world_size, -1)
            self._pack_rows(grads, send, start, own_row_in_grads, scale, divide_by)

        def read(slot: int, start: int, stop: int) -> None:
            self._sum_own_rows(slots, slot, grads, result[start:stop], start, own_row_in_grads, scale)

        announce("reduce_scatter", "shm::reduce_scatter", payload((world_size, columns), dtype), world_size)
        per_chunk = slots.slot_bytes // (world_size * dtype.itemsize)
        last = self._stream(slots, columns, per_chunk, world_size * dtype.itemsize, pack, read, stamp)

        def finish() -> torch.Tensor:
            last()  # ``grads`` stayed alive in this closure until now
            return result

        return Pending(finish)

    def _pack_rows(
        self,
        grads: list[RankRows],
        send: torch.Tensor,
        start: int,
        own_row_in_grads: bool,
        scale: float,
        divide_by: int | None,
    ) -> None:
        """Columns ``start`` on of ``grads``' rows into this rank's (world_size, columns) ``send``."""
        if own_row_in_grads:  # see [Note: the own row stays in the gradient] in packing.py
            packing.pack_peer_rows(grads, send, self.rank, scale, start)
        else:
            packing.pack_rows(grads, send, start)
            if divide_by is not None:
                send.div_(divide_by)

    def _sum_own_rows(
        self,
        slots: SlotSet,
        slot: int,
        grads: list[RankRows],
        out: torch.Tensor,
        start: int,
        own_row_in_grads: bool,
        scale: float,
    ) -> None:
        """``out``: this rank's row of every rank's ``slot`` summed (columns ``start`` on), its own from ``grads``
        where it stayed there."""
        world_size, width = self.world_size, out.numel()
        rows = [
            self.view(slots, rank, slot, world_size * width, out.dtype).view(world_size, width)[self.rank]
            for rank in range(world_size)
        ]
        if own_row_in_grads:
            peers = [row for rank, row in enumerate(rows) if rank != self.rank]
            packing.sum_own_row(grads, self.rank, peers, scale, out, start)
        else:
            packing.sum_rows(rows, out)

    def divides_exactly(self, divisor: int, grads: list[RankRows], dtype: torch.dtype) -> bool:
        """Reduce-scatters of gradients already in ``dtype`` keep the own row in the gradients and, for a
        power-of-two ``divisor``, divide inside copies they make anyway (see [Note: the own row stays in the
        gradient] in ``packing.py``)."""
        power_of_two = divisor > 0 and divisor & (divisor - 1) == 0
        same_dtype = all(grad.flat.dtype == dtype or grad.flat.numel() == 0 for grad in grads)
        return power_of_two and same_dtype and self.slots["reduce"].has_free()  # not gloo's pass over W rows

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        slots = self.slots["reduce"]
        if numel * dtype.itemsize > slots.slot_bytes:
            return self._all_reduce_chunked(grads, numel, dtype, stamp, divide_by)
        taken = self._take(slots, numel * dtype.itemsize, stamp)
        if taken is None:
            return self.fallback.all_reduce(grads, dtype, stamp, divide_by)
        slot, sequence = taken
        send = self.view(slots, self.rank, slot, numel, dtype)
        packing.pack(grads, send)
        if divide_by is not None:
            send.div_(divide_by)
        announce("all_reduce", "shm::all_reduce", send, self.world_size)
        self._publish(slots, slot, sequence, stamp)

        def finish() -> torch.Tensor:
            self._await_published(slots, slot, sequence, stamp)
            result = packing.sum_rows([self.view(slots, r, slot, numel, dtype) for r in range(self.world_size)])
            self._release(slots, slot, sequence)
            return result

        return Pending(finish)

    def _all_reduce_chunked(
        self, grads: list[torch.Tensor], numel: int, dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None
    ) -> Pending[torch.Tensor]:
        """An all-reduce larger than a slot, summed chunk by chunk into its result (see [Note: chunks])."""
        slots = self.slots["reduce"]
        if not slots.has_free():
            return self.fallback.all_reduce(grads, dtype, stamp, divide_by)
        result = torch.empty(numel, dtype=dtype, device=grads[0].device)

        def pack(slot: int, start: int, stop: int) -> None:
            send = self.view(slots, self.rank, slot, stop - start, dtype)
            packing.pack(grads, send, start)
            if divide_by is not None:
                send.div_(divide_by)

        def read(slot: int, start: int, stop: int) -> None:
            views = [self.view(slots, rank, slot, stop - start, dtype) for rank in range(self.world_size)]
            packing.sum_rows(views, result[start:stop])

        announce("all_reduce", "shm::all_reduce", payload((numel,), dtype), self.world_size)
        last = self._stream(slots, numel, slots.slot_bytes // dtype.itemsize, dtype.itemsize, pack, read, stamp)

        def finish() -> torch.Tensor:
            last()
            return result

        return Pending(finish)

    def _stream(
        self,
        slots: SlotSet,
        total: int,
        per_chunk: int,
        unit_bytes: int,
        pack: Callable[[int, int, int], None],
        read: Callable[[int, int, int], None],
        stamp: Stamp | None,
    ) -> Callable[[], None]:
        """Run one collective as chunks of ``per_chunk`` of its ``total`` units (elements or columns of
        ``unit_bytes`` each) through ``slots``, which has a free slot: ``pack(slot, start, stop)`` writes this rank's
        part of a chunk into its slot, ``read(slot, start, stop)`` reads every rank's once all are published.

        Returns the read of the last chunk, for the collective's ``wait``; see [Note: chunks].
        """
        in_flight: deque[tuple[int, int, int, int]] = deque()  # (slot, sequence, start, stop), oldest first

        def read_oldest() -> None:
            slot, sequence, start, stop = in_flight.popleft()
            self._await_published(slots, slot, sequence, stamp)
            read(slot, start, stop)
            self._release(slots, slot, sequence)

        for start in range(0, total, per_chunk):
            stop = min(start + per_chunk, total)
            if in_flight and (len(in_flight) == PIPELINE or not slots.has_free()):
                read_oldest()
            taken = self._take(slots, (stop - start) * unit_bytes, stamp)
            assert taken is not None, "a slot is free: this rank released one or the set had one"
            slot, sequence = taken
            pack(slot, start, stop)
            self._publish(slots, slot, sequence, stamp)
            in_flight.append((slot, sequence, start, stop))
        while len(in_flight) > 1:
            read_oldest()
        return read_oldest
