"""The identity of every unit collective -- a sequence number, a kind, a byte count, the unit's name -- checked on
every rank before the data is trusted.

Every collective of a unit carries a ``Stamp`` with its data, not in a collective of its own, and every rank compares
the stamps it receives with its own (see [Note: collective identity] above ``Stamp``). A mismatch raises
``CollectiveMismatchError`` on every rank that sees it, naming the units each rank was in.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
STAMP_NUMEL = 4  # int64: sequence number, kind, byte count, hash of the unit's name
STAMP_BYTES = STAMP_NUMEL * 8
DIGEST_BITS = 24  # elements a summing collective carries: one bit of the stamp's digest each


class CollectiveMismatchError(RuntimeError):
    """Ranks entered different collectives: a unit run on some ranks only, or with different sizes."""


def _label_hash(label: str) -> int:
    return zlib.crc32(label.encode())


class Ledger:
    """Numbers the unit collectives of one root; every rank must produce the same sequence of stamps."""

    def __init__(self, labels: list[str]) -> None:
        self.sequence = 0
        self._label_of = {_label_hash(label): label for label in labels}

    def stamp(self, kind: str, nbytes: int, label: str) -> Stamp:
        self.sequence += 1
        return Stamp(self, self.sequence, KINDS.index(kind), nbytes, label)

    def describe(self, values: list[int]) -> str:
        sequence, kind, nbytes, label = values
        if not 0 <= kind < len(KINDS):
            return "no collective of this model (nothing was written there yet)"
        name = self._label_of.get(label, "a unit this rank does not know")
        return f"{KINDS[kind]} #{sequence} of unit '{name}' ({nbytes} bytes)"


_ADVICE = (
    "Every rank must run the same units in the same order with the same shapes; a unit used on some ranks only (a "
    "branch that depends on the rank or on the data) is not supported: run it on every rank, or keep it out of the "
    "sharded model (ignored_modules)."
)


# [Note: collective identity] Ranks must issue the same collectives in the same order. When they do not (a unit run on
# one rank only, a branch taken on some ranks), a shared-memory collective would still complete -- its counters only
# count uses of a slot -- and read whatever the other rank's slot held, and a gloo collective of equal size would
# complete with another unit's data. So every collective of a unit carries a ``Stamp``, and it travels with the data: no
# collective of its own. Over shared memory it is written into the slot's header before the counter that publishes the
# data and compared with every other rank's header after it. Over gloo and NCCL it is a few extra bytes at the end of
# what each rank sends (``frame``): an all-gather or all-to-all delivers every rank's stamp whole, compared after the
# wait; a summing collective (all-reduce, NCCL's reduce-scatter) delivers the sum, so it carries the stamp's ``digest``
# as ``DIGEST_BITS`` elements of 0 or 1, whose sum is 0 or W on every rank exactly when every rank sent the same bits
# (any disagreeing bit sums to something in between, so every rank sees it).
#
# A mismatch raises ``CollectiveMismatchError`` on every rank that sees it, naming the units each rank was in. Its
# limit: collectives of different sizes cannot complete over gloo or NCCL, so such a mismatch ends in the backend's own
# error (or its timeout) before any stamp is read. ``benchmarks/bench_checks.py`` measures the cost.
class Stamp:
    """One collective's identity as this rank issues it."""

    __slots__ = ("kind", "label", "ledger", "nbytes", "sequence")

    def __init__(self, ledger: Ledger, sequence: int, kind: int, nbytes: int, label: str) -> None:
        self.ledger, self.sequence, self.kind, self.nbytes, self.label = ledger, sequence, kind, nbytes, label

    def values(self) -> list[int]:
        return [self.sequence, self.kind, self.nbytes, _label_hash(self.label)]

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(self.values(), dtype=torch.int64)

    def as_bytes(self) -> torch.Tensor:
        """The stamp as the ``STAMP_BYTES`` uint8 a rank appends to what it sends."""
        return self.as_tensor().view(torch.uint8)

    def tag(self) -> int:
        """A gloo message tag (a non-negative int32) that only this collective's messages carry, on every rank:
        see [Note: gathers point to point] in ``gloo.py``."""
        return zlib.crc32(repr(self.values()).encode()) & 0x7FFFFFFF

    def digest(self, dtype: torch.dtype) -> torch.Tensor:
        """``DIGEST_BITS`` elements of 0 or 1 in ``dtype``: the bits of a hash of the stamp, for summing collectives."""
        bits = zlib.crc32(repr(self.values()).encode()) & ((1 << DIGEST_BITS) - 1)
        return torch.tensor([(bits >> i) & 1 for i in range(DIGEST_BITS)], dtype=dtype)

    def verify(self, stamps: torch.Tensor | list[list[int]], group: ProcessGroup | None) -> None:
        """``stamps``: (world_size, STAMP_NUMEL), every rank's stamp for this collective (a tensor, or its rows as
        lists of ints); raise if one differs."""
        mine = self.values()
        for group_rank, values in enumerate(stamps.tolist() if isinstance(stamps, torch.Tensor) else stamps):
            if values != mine:
                rank = dist.get_global_rank(group, group_rank) if group is not None else group_rank
                raise CollectiveMismatchError(
                    f"ranks entered different collectives: rank {dist.get_rank()} is in the "
                    f"{self.ledger.describe(mine)} but rank {rank} is in the {self.ledger.describe(values)}. {_ADVICE}"
                )

    def verify_bytes(self, framed: torch.Tensor, group: ProcessGroup | None) -> None:
        """``framed``: (world_size, STAMP_BYTES) uint8, every rank's appended stamp (any row stride)."""
        self.verify(framed.contiguous().view(torch.int64), group)

    def verify_digest(self, summed: torch.Tensor, world_size: int) -> None:
        """``summed``: the sum over ranks of every rank's ``digest``; each bit must sum to 0 or ``world_size``."""
        expected = self.digest(torch.float64) * world_size
        if not torch.equal(summed.to(torch.float64).cpu(), expected):
            raise CollectiveMismatchError(
                f"ranks entered different collectives: rank {dist.get_rank()} is in the "
                f"{self.ledger.describe(self.values())} but another rank of its group is in another one. {_ADVICE}"
            )
