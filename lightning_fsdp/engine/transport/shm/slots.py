"""The slots of a rank's segment: a set for all-gathers and a set for reductions, each use published and read through
counters in a header.

Every rank takes the same slot for the same collective, so readers know where to look (see [Note: slots] above
``SlotSet``), and a slot's size is bounded whatever the model: a larger collective streams through the slots in chunks
(see [Note: chunks] above ``slot_bytes``).
"""

from __future__ import annotations

from collections import deque

from lightning_fsdp.engine.transport.base import SHARED_MEMORY_CHUNK_MIB, chunk_limit
from lightning_fsdp.engine.transport.identity import STAMP_NUMEL

SLOTS = {"all_gather": 3, "reduce": 2}  # slots per set: a gather in use, two prefetched; a reduction behind another


# [Note: chunks] A slot holds at most ``LIGHTNING_FSDP_CHUNK_MIB`` MiB (``SHARED_MEMORY_CHUNK_MIB``; less where no unit
# sends as much), so the segment's size is fixed whatever the model: a language model's root (its embedding and head,
# the largest tensors of the model) does not size it, nor leave shared memory for gloo. A larger collective is cut into
# chunks of a slot each (all-gather and all-reduce: elements of the packed buffer; reduce-scatter: columns of the
# (world_size, columns) gradient rows, so each chunk still holds every rank's part) and each chunk is one use of a slot
# like any other: stamped, published, awaited with the same timeout and dead-peer detection, released. Chunks are
# pipelined over two slots where two are free: a rank packs chunk k + 1 while its peers read chunk k. The chunks run
# when the collective is issued, except the last, which its ``wait`` reads: a chunked collective holds at most one slot
# between calls, so it never takes the slots of the gathers prefetched after it. What a chunk's readers copy out goes
# into buffers of the transport's pool (an all-gather's result: world_size blocks) or straight into the result (a
# reduction's sum), so a chunked reduction copies no more than one in a single slot, and a chunked all-gather one copy
# more (slot to result) than the views of a single slot.
def slot_bytes(send_bytes: dict[str, int], world_size: int) -> dict[str, int]:
    """The data each set's slots hold: the largest send buffer of each collective kind, at most
    ``chunk_limit(SHARED_MEMORY_CHUNK_MIB)`` (see [Note: chunks]), and at least one column of a reduce-scatter in the
    widest dtype."""
    reduce = max(send_bytes.get("reduce_scatter", 0), send_bytes.get("all_reduce", 0))
    limit = max(chunk_limit(SHARED_MEMORY_CHUNK_MIB), world_size * 8)
    return {"all_gather": _aligned(min(send_bytes.get("all_gather", 0), limit)), "reduce": _aligned(min(reduce, limit))}


_ALIGN = 64  # bytes: keeps every slot aligned for vectorised copies of any dtype
HEADER_BYTES = _ALIGN  # int64 words: the collective's identity (see [Note: collective identity] in identity.py), then
PUBLISHED = STAMP_NUMEL  # the use of the slot whose data this rank has written,
READ = STAMP_NUMEL + 1  # and the use of the slot whose data this rank has read from every rank
# Each segment starts with one more header, the rank's: the sequence number of the last collective it published in
# any slot, and that collective's stamp (see [Note: a rank in another collective]).
LATEST = 0
LATEST_STAMP = 1


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# [Note: slots] Each rank's segment is cut into slots, one per collective in flight, in two sets sized by what each
# collective sends (``SLOTS``): all-gathers send a unit's shard, reductions (reduce-scatters: W shards of gradients;
# all-reduces: the whole gradient) much more. A collective takes the free slot of its set that has been free the
# longest: every rank issues and finishes the engine's collectives in the same order, so every rank takes the same slot,
# which is how readers know where to look. Every use of a slot has a sequence number, the same on every rank. A rank
# publishes its data by writing that number into the slot's header after the data; readers wait until every rank's
# header shows it (see [Note: counters instead of barriers] in ``peer_wait.py``). A slot is free again once this rank
# has read the data of its collective (``release``, which writes the number into the header's read counter), and is
# written again only after every other rank's read counter says it has read it too. Taking the longest-free slot rather
# than the lowest gives the slowest reader time: reusing the slot just released would make every rank wait for it. A
# collective larger than a slot streams through the slots in chunks (see [Note: chunks]); only when every slot of its
# set is taken does it run over gloo instead (every rank sees the same busy slots, so all of them do): a training step
# keeps at most two gathers and two reductions in flight.
class SlotSet:
    """``count`` slots of ``slot_bytes`` (each after a header) starting at byte ``offset`` of every segment.

    ``acquire`` and ``release`` are this rank's bookkeeping; see [Note: slots] for why every rank agrees on it.
    ``last_use[slot]`` is the sequence number of the slot's latest use (0: never used).
    """

    def __init__(self, offset: int, count: int, slot_bytes: int) -> None:
        self.offset = offset
        self.count = count
        self.slot_bytes = slot_bytes  # the data a slot holds, after its header
        self.stride = HEADER_BYTES + slot_bytes
        self._free = deque(range(count))  # free slots, the longest free first
        self.last_use = [0] * count

    @property
    def nbytes(self) -> int:
        return self.count * self.stride

    def has_free(self) -> bool:
        """Whether the next collective gets a slot (else it runs over gloo)."""
        return bool(self._free)

    def acquire(self, nbytes: int) -> int | None:
        """The slot for the next collective (or chunk), or None: it does not fit, or every slot is in flight."""
        if nbytes > self.slot_bytes or not self._free:
            return None
        return self._free.popleft()

    def release(self, slot: int) -> None:
        """This rank has read what it needed from every rank's ``slot``; the slot is written again after all have."""
        self._free.append(slot)

    def start(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in a segment."""
        return self.offset + slot * self.stride
