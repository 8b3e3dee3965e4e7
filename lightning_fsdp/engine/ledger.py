"""The identity of every unit collective -- a sequence number, a kind, a byte count, the unit's name -- checked on
every rank before the data is trusted.

[Note: collective identity] Ranks must issue the same collectives in the same order. When they do not (a unit run on
one rank only, a branch taken on some ranks), a shared-memory collective would still complete -- its barriers only
count calls -- and read whatever the other rank's slot held, and a gloo collective of another size aborts the
process or waits for the timeout. So every collective of a unit carries a ``Stamp``: over shared memory it is
written into the slot's header before the barrier that publishes the data and compared with every other rank's
header after it (no extra collective). Otherwise (gloo alone, between hosts, NCCL) it is exchanged in one all-gather
of four integers before the data collective is issued, on a gloo group of its own over the same ranks: the stamp is a
CPU tensor whatever the data's backend, and it does not queue behind the data collectives in flight.

A mismatch raises ``CollectiveMismatchError`` on every rank that sees it, naming the units each rank was in.
``benchmarks/bench_checks.py`` measures the cost: the headers take under 0.5% of a step of the benchmark model; the
gloo exchange is a synchronisation point per collective, which costs a prefetch the head start a rank had over the
slower one (measured 4-5% of the step on the shared 2-core machine, where ranks drift apart most).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.comm_stats import as_handshake

# torch 2.13 renamed the flat-tensor all-gather; older releases only have the old name.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
STAMP_NUMEL = 4  # int64: sequence number, kind, byte count, hash of the unit's name


class CollectiveMismatchError(RuntimeError):
    """Ranks entered different collectives: a unit run on some ranks only, or with different sizes."""


def _label_hash(label: str) -> int:
    return zlib.crc32(label.encode())


_HANDSHAKE_GROUPS: WeakKeyDictionary[ProcessGroup, ProcessGroup] = WeakKeyDictionary()


def handshake_group(group: ProcessGroup) -> ProcessGroup:
    """A gloo group over ``group``'s ranks for stamp exchanges; a collective over them the first time."""
    if group not in _HANDSHAKE_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _HANDSHAKE_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _HANDSHAKE_GROUPS[group]


class Ledger:
    """Numbers the unit collectives of one root; every rank must produce the same sequence of stamps.

    ``groups``: the groups the root's units communicate over; each gets its handshake group now, while every rank
    is in the root's lazy init.
    """

    def __init__(self, labels: list[str], groups: list[ProcessGroup]) -> None:
        self.sequence = 0
        self._label_of = {_label_hash(label): label for label in labels}
        self.handshakes = {group: handshake_group(group) for group in groups}

    def stamp(self, kind: str, nbytes: int, label: str) -> Stamp:
        self.sequence += 1
        return Stamp(self, self.sequence, KINDS.index(kind), nbytes, label)

    def describe(self, values: list[int]) -> str:
        sequence, kind, nbytes, label = values
        if not 0 <= kind < len(KINDS):
            return "no collective of this model (nothing was written there yet)"
        name = self._label_of.get(label, "a unit this rank does not know")
        return f"{KINDS[kind]} #{sequence} of unit '{name}' ({nbytes} bytes)"


@dataclass(frozen=True)
class Stamp:
    """One collective's identity as this rank issues it."""

    ledger: Ledger
    sequence: int
    kind: int
    nbytes: int
    label: str

    def values(self) -> list[int]:
        return [self.sequence, self.kind, self.nbytes, _label_hash(self.label)]

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(self.values(), dtype=torch.int64)

    def verify(self, stamps: torch.Tensor, group: ProcessGroup) -> None:
        """``stamps``: (world_size, STAMP_NUMEL), every rank's stamp for this collective; raise if one differs."""
        mine = self.values()
        for group_rank, values in enumerate(stamps.tolist()):
            if values != mine:
                rank = dist.get_global_rank(group, group_rank)
                here = self.ledger.describe(mine)
                there = self.ledger.describe(values)
                raise CollectiveMismatchError(
                    f"ranks entered different collectives: rank {dist.get_rank()} is in the {here} but rank {rank} "
                    f"is in the {there}. Every rank must run the same units in the same order with the same shapes; "
                    "a unit used on some ranks only (a branch that depends on the rank or on the data) is not "
                    "supported: run it on every rank, or keep it out of the sharded model (ignored_modules)."
                )

    def exchange(self, group: ProcessGroup) -> None:
        """Over gloo: one all-gather of every rank's stamp, before the data collective is issued."""
        mine = self.as_tensor()
        stamps = mine.new_empty(group.size() * STAMP_NUMEL)
        with as_handshake():
            _all_gather_flat(stamps, mine, group=self.ledger.handshakes.get(group) or handshake_group(group))
        self.verify(stamps.view(group.size(), STAMP_NUMEL), group)
