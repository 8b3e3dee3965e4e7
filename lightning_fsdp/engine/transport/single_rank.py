"""The transport of a group of one rank: the collectives only pack (and cast), so a unit runs its usual code."""

from __future__ import annotations

import torch

from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.base import Pending, Transport
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.packing import RankRows


class SingleRank(Transport):
    """No other rank: the collectives only pack (and cast)."""

    synchronous = True

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        send = self.pool.take(sum(shard.numel() for shard in shards), dtype, shards[0].device)
        packing.pack([shard.reshape(-1) for shard in shards], send)
        return Pending.done([send], lambda: self.pool.give(send))

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        out = torch.empty(1, sum(grad.columns for grad in grads), dtype=dtype, device=grads[0].flat.device)
        packing.pack_rows(grads, out)
        return Pending.done(_divided(out.view(-1), divide_by))

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        out = torch.empty(sum(grad.numel() for grad in grads), dtype=dtype, device=grads[0].device)
        packing.pack(grads, out)
        return Pending.done(_divided(out, divide_by))


def _divided(packed: torch.Tensor, divide_by: int | None) -> torch.Tensor:
    """The packed result of its own (never pooled: it becomes ``.grad``), divided if asked."""
    return packed if divide_by is None else packed.div_(divide_by)
