"""Collectives over ranks on several hosts in two stages: shared memory inside each host, one exchange between hosts.

A flat ring over all W ranks of H hosts sends 2(W-1)/W of the data through each host's NIC. Run in two stages, inside
each host (shared memory) and between hosts over each rank's *column* (rank ``l`` of every host, over gloo), a host
sends 2(H-1)/H of the data per gather and reduction pair, however many ranks it has (see [Note: two stages] above
``HierarchicalTransport``). A unit may keep what a gather's first stage leaves from forward to backward, so that
backward gathers inside the host only (see [Note: resharded to the host]).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.options import CrossHostPrecision
from lightning_fsdp.engine.transport.base import Pending, Transport
from lightning_fsdp.engine.transport.compressed import link_transport
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.hosts import HostLayout
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.packing import RankRows
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport, timeout_of

# Subgroups made per parent group, by their world ranks: a second root over the same group reuses them.
_SUBGROUPS: WeakKeyDictionary[ProcessGroup, dict[tuple[int, ...], ProcessGroup]] = WeakKeyDictionary()


def subgroup(parent: ProcessGroup, group_ranks: tuple[int, ...]) -> ProcessGroup:
    """The gloo group of ``group_ranks`` of ``parent``, made by its members only (the other ranks of ``parent`` make
    theirs at the same time), with ``parent``'s timeout."""
    ranks = tuple(dist.get_global_rank(parent, r) for r in group_ranks)
    made = _SUBGROUPS.setdefault(parent, {})
    if ranks not in made:
        made[ranks] = dist.new_group(
            list(ranks), backend="gloo", timeout=timeout_of(parent), use_local_synchronization=True
        )
    return made[ranks]


# [Note: two stages] A flat ring over all W ranks of H hosts sends 2(W-1)/W of the data through each host's NIC. With L
# ranks a host, numbered host after host (group rank ``h * L + l``), each collective instead runs as
#
# - all-gather: first between hosts, over this rank's *column* (rank ``l`` of every host), each rank its own shard, so
#   that the column holds the rows of all its H ranks; then inside the host, over shared memory, those H blocks of every
#   rank of the host: every rank has all W shards. Per host, (H-1)/H of the unit crosses the link.
# - reduce-scatter: first inside the host (shared memory), where rank ``l`` receives the host's sum of the rows of its
#   column (rows ``h * L + l`` for every h); then between hosts, over the column, a reduce-scatter of those H rows,
#   which leaves rank ``h * L + l`` its own row summed over every rank. (H-1)/H of the gradient a host.
# - all-reduce (NO_SHARD over several hosts): a reduce-scatter inside the host, an all-reduce of each rank's 1/L of it
#   over its column, an all-gather inside the host.
#
# So a host sends 2(H-1)/H of the data per gather and reduction pair, whatever L. Each stage carries the collective's
# stamp, so a rank in another collective is named in either. The stage between hosts runs on gloo's threads behind
# compute: a gather's starts when it is issued (the host stage is in its wait), a reduction's as soon as the host stage
# ends, which, in shared memory, is when its call returns.
class HierarchicalTransport(Transport):
    """``inside``: this rank's host (shared memory where it can map it); ``across``: its column, gloo between hosts."""

    def __init__(self, group: ProcessGroup, layout: HostLayout, inside: Transport, across: Transport) -> None:
        super().__init__(group)
        self.inside, self.across = inside, across
        self.num_hosts, self.ranks_per_host = layout.num_hosts, layout.ranks_per_host
        self.host = layout.host_index
        self.crosses_hosts = True
        self.name = f"two-stage ({inside.name} inside each of {self.num_hosts} hosts, {across.name} between them)"

    @staticmethod
    def create(
        group: ProcessGroup, layout: HostLayout, send_bytes: dict[str, int], precision: CrossHostPrecision | None
    ) -> HierarchicalTransport:
        """Collectives over ``group``'s hosts and columns: makes their groups and the host's shared memory."""
        per_host = layout.ranks_per_host
        assert per_host is not None and layout.host_major, "see HostLayout.host_major"
        column = tuple(h * per_host + layout.local_index for h in range(layout.num_hosts))
        across = link_transport(subgroup(group, column), precision)
        host_group = subgroup(group, layout.hosts[layout.host_index])
        inside_bytes = {  # the host stage moves H blocks a gather, every row of a reduction, 1/L of an all-reduce
            "all_gather": max(
                layout.num_hosts * send_bytes.get("all_gather", 0), -(-send_bytes.get("all_reduce", 0) // per_host)
            ),
            "reduce_scatter": send_bytes.get("reduce_scatter", 0),
            "all_reduce": send_bytes.get("all_reduce", 0),
        }
        shared, _ = SharedMemoryTransport.create(host_group, inside_bytes)
        inside = shared if shared is not None else GlooTransport(host_group)
        return HierarchicalTransport(group, layout, inside, across)

    @property
    def resident_bytes(self) -> int:
        return self.inside.resident_bytes + self.across.resident_bytes

    def end_step(self) -> None:
        super().end_step()
        self.inside.end_step()
        self.across.end_step()

    def close(self) -> None:
        """Both stages' transports; the subgroups stay with their parent group for the next root over it."""
        super().close()
        self.inside.close()
        self.across.close()

    # ----- gathers ---------------------------------------------------------------------------------------------

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        numel = sum(shard.numel() for shard in shards)
        out = self.pool.take(self.world_size * numel, dtype, shards[0].device)
        pending = self.all_gather_into([torch.cat([s.reshape(-1) for s in shards])], dtype, stamp, [out])

        def finish() -> list[torch.Tensor]:
            pending.wait()
            return list(out.view(self.world_size, numel).unbind(0))

        return Pending(finish, lambda: self.pool.give(out))

    def all_gather_into(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """See [Note: two stages]: the column's rows into temporaries, then the host's into ``dests``."""
        host_rows = [self.pool.take(self.num_hosts * shard.numel(), dtype, shard.device) for shard in shards]
        pending = self.all_gather_to_host(shards, dtype, stamp, dests, host_rows)

        def finish() -> None:
            pending.wait()
            for rows in host_rows:
                self.pool.give(rows)

        return Pending(finish)

    # [Note: resharded to the host] What a gather's first stage leaves -- the rows of this rank's column -- is 1/L of
    # the unit: the host's ranks together hold all of it. ``reshard_after_forward=L`` (FSDP2's int form) keeps those
    # rows from forward to backward, so backward gathers the full parameters inside the host only and nothing crosses
    # the link.
    def all_gather_to_host(
        self,
        shards: list[torch.Tensor],
        dtype: torch.dtype,
        stamp: Stamp | None,
        dests: list[torch.Tensor],
        host_rows: list[torch.Tensor],
    ) -> Pending[None]:
        across = self.across.all_gather_into(shards, dtype, stamp, host_rows)

        def finish() -> None:
            across.wait()
            self.gather_in_host(host_rows, dtype, stamp, dests).wait()

        return Pending(finish)

    def gather_in_host(
        self, host_rows: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """Every host rank's column rows into ``dests``: piece (h, i) of local rank l is row ``h * L + l`` of
        ``dests[i]``, and the rows of host h are one slice of it (see [Note: two stages])."""
        hosts, per_host = self.num_hosts, self.ranks_per_host
        pieces, piece_dests = [], []
        for h in range(hosts):
            for rows, dest in zip(host_rows, dests, strict=True):
                pieces.append(rows.view(hosts, -1)[h])
                piece_dests.append(dest.view(self.world_size, -1)[h * per_host : (h + 1) * per_host])
        return self.inside.all_gather_into(pieces, dtype, stamp, piece_dests)

    # ----- reductions ------------------------------------------------------------------------------------------

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        """See [Note: two stages]: inside the host now, between hosts behind compute."""
        per_host = self.ranks_per_host
        pieces = [
            RankRows(_rows(grad, h * per_host, (h + 1) * per_host), grad.columns)
            for h in range(self.num_hosts)
            for grad in grads
        ]
        columns = sum(grad.columns for grad in grads)
        partial = self.inside.reduce_scatter(pieces, dtype, stamp, divide_by).wait()
        return self.across.reduce_scatter([RankRows(partial, columns)], dtype, stamp)

    def divides_exactly(self, divisor: int, grads: list[RankRows], dtype: torch.dtype) -> bool:
        return self.inside.divides_exactly(divisor, grads, dtype)

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        columns = -(-numel // self.ranks_per_host)
        flat = torch.cat([grad.reshape(-1).to(dtype) for grad in grads])
        part = self.inside.reduce_scatter([RankRows(flat, columns)], dtype, stamp, divide_by).wait()
        summed = self.across.all_reduce([part], dtype, stamp)

        def finish() -> torch.Tensor:
            out = torch.empty(self.ranks_per_host * columns, dtype=dtype, device=flat.device)
            self.inside.all_gather_into([summed.wait()], dtype, stamp, [out]).wait()
            return out[:numel]

        return Pending(finish)


def _rows(grad: RankRows, first: int, stop: int) -> torch.Tensor:
    """Rows ``[first, stop)`` of the gradient's zero-padded (world_size, columns) view, short where padding starts."""
    numel = grad.flat.numel()
    return grad.flat[min(first * grad.columns, numel) : min(stop * grad.columns, numel)]
