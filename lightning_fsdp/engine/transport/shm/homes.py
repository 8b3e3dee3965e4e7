"""Homes: where each unit's shards live in a rank's segment, so that a gather packs nothing.

A unit's shards are the same bytes at every gather, so they live in a home of their own in this rank's segment, and a
gather publishes them as they are; the end of a step waits until every peer has read them before the optimizer may
write them again (see [Note: shards that live in shared memory] above ``Homes``).
"""

from __future__ import annotations

import torch

from lightning_fsdp.engine.transport.shm import segment
from lightning_fsdp.engine.transport.shm.segment import PAGE
from lightning_fsdp.engine.transport.shm.slots import HEADER_BYTES

MAX_HOMED_SHARDS = 8192  # mappings a rank makes for homes at most, far below the kernel's default limit of 65530


def map_homes(fd: int, homes: Homes) -> list[list[torch.Tensor]] | None:
    """Every shard of ``homes`` mapped as a storage of its own; None where the kernel refused a mapping (its limit on
    a process's mappings, ``vm.max_map_count``)."""
    try:
        return [
            [segment.map_range(fd, offset, size) for offset, size in zip(offsets, sizes, strict=True)]
            for offsets, sizes in zip(homes.offsets, homes.shards, strict=True)
        ]
    except OSError:
        return None


# [Note: shards that live in shared memory] A gather through a slot copies this rank's shards into it first, and its
# chunks are read while the gather is issued, so the issuing rank waits there for the others. But a unit's shards are
# the same bytes every time, so each unit that gathers through this transport keeps them in a *home* of its own in this
# rank's segment (``home_for_shards``): the parameters' shards become tensors whose memory is there, and the optimizer
# steps them there. A gather of a unit whose shards are at home packs nothing and publishes at once, and its ``wait``
# copies every rank's shards into the unsharded buffers. Homes are laid out after the slots in the order the units claim
# them (the same on every rank, so every rank finds a peer's shard at its own shard's offset): a header per home (the
# stamp, a counter that says which gather has published it and one that says which this rank has read), then each shard
# from a page boundary of its own, which this rank maps once more, alone (``segment.map_range``): a shard's storage is
# its own bytes, not the segment, so copying one (``copy.deepcopy``, DCP's staging) copies that shard only. A model of
# more than ``MAX_HOMED_SHARDS`` shards, or a rank the kernel refuses a mapping (``vm.max_map_count``), gets no homes,
# on every rank alike: its gathers pack into the slots.
#
# A home's bytes change when the optimizer steps them (or a checkpoint is loaded into them), which a rank does only
# after its forward or backward has returned; a peer must not be reading them then. So the end of a step (``end_step``:
# after a backward, or a forward without one) waits until every peer has read every gather this rank's homes published.
# After a backward that wait costs nothing: a peer reads a unit's gather before its backward of the unit, so before its
# reduction of it, which this rank has waited for. A gather whose shards are not at home (a cast to another dtype, host
# rows of ``hierarchical.py``) goes through the slots.
class Homes:
    """The homes of the units' shards (see [Note: shards that live in shared memory]) in every segment: after byte
    ``offset``, a header per home, then every shard's bytes from a page boundary of its own (so that this rank maps
    each shard as a storage of its own: a copy of one -- ``copy.deepcopy``, DCP's staging -- copies that shard only).
    ``shards[i]``: the bytes of home i's shards; ``last_use[i]``: the sequence number of home i's latest gather (0:
    none yet)."""

    def __init__(self, offset: int, shards: tuple[tuple[int, ...], ...]) -> None:
        self.shards = shards
        self.starts = [offset + home * HEADER_BYTES for home in range(len(shards))]
        offset += len(shards) * HEADER_BYTES
        self.offsets: list[list[int]] = []  # where each shard's bytes begin
        for sizes in shards:
            self.offsets.append([])
            for size in sizes:
                offset = -(-offset // PAGE) * PAGE
                self.offsets[-1].append(offset)
                offset += size
        self.end = offset
        self.last_use = [0] * len(shards)
        self.claimed = 0  # homes handed out so far, in order

    def start(self, home: int) -> int:
        """Byte offset of ``home``'s header in a segment."""
        return self.starts[home]


def too_many(shard_homes: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a model has more shards than a rank maps homes for (the same answer on every rank)."""
    return sum(len(sizes) for sizes in shard_homes) > MAX_HOMED_SHARDS
