"""The replicas' sum of an embedding's gradient between hosts: only the rows some replica touched cross the link.

``sum_over_replicas_by_rows`` is HYBRID's all-reduce over replicas with an untied embedding's gradient sent by its
non-zero rows, exactly: see [Note: an embedding's rows between hosts], above it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_fsdp.engine.diagnostics.hang_watch import wait_work
from lightning_fsdp.engine.diagnostics.step_stats import STEP_STATS
from lightning_fsdp.engine.transport.base import Pending, Transport
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.packing import nonzero_rows


class RowRegion(NamedTuple):
    """A row-sparse gradient's rows inside a unit's flat shard: ``rows`` rows of ``row_numel`` from ``offset``."""

    offset: int
    rows: int
    row_numel: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.rows * self.row_numel].view(self.rows, self.row_numel)


# [Note: an embedding's rows between hosts] An ``nn.Embedding``'s gradient is zero in every row no token of the step
# looked up: a step of a few thousand tokens touches a few thousand rows of a vocabulary of tens of thousands, and the
# rest of the gradient is zeros that DDP and a dense all-reduce send anyway. Between hosts that is most of the bytes of
# a language model's root unit, and the root's reduction is the last of backward: nothing is left to hide it behind.
#
# So HYBRID's sum over replicas, when it crosses hosts, sends such a gradient by rows, exactly:
#
# 1. every replica marks the rows of its shard that are non-zero, and a MAX all-reduce of those marks (one byte a row)
#    gives every replica the same union;
# 2. the union's rows are all-reduced, in the same transport (and so the same wire precision) as the rest;
# 3. the shard's rows outside the union are zero on every replica, this one included, so their sum is already in
#    place: the union's sums are copied into their rows, and that is the result.
#
# The rest of the unit (the head, norms) is all-reduced densely as soon as the shard stage is done, behind the marks.
# The union is found from the values, not assumed from the tokens, so a gradient that is dense after all (a hook, a
# weight tied to a head) is summed correctly, only with no saving. Which parameters take this path is decided at
# wrapping (``FSDPParam.rows_sparse``: the untied weight of an ``nn.Embedding``), the same on every rank.
def sum_over_replicas_by_rows(
    transport: Transport, flat: torch.Tensor, regions: list[RowRegion], stamp: Stamp | None, unit: str
) -> Pending[torch.Tensor]:
    """``transport.all_reduce([flat])``, with ``regions`` sent by their non-zero rows (see the Note). The result is
    ``flat`` itself, summed in place. The bytes sent are counted for ``unit`` in ``STEP_STATS``."""
    group, itemsize = transport.group, flat.dtype.itemsize
    marks = torch.cat([nonzero_rows(region.of(flat)) for region in regions]).to(torch.uint8)
    marks_work = dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=group, async_op=True)
    dense = _dense_pieces(flat, regions)
    dense_sum = transport.all_reduce(dense, flat.dtype, stamp) if dense else None
    STEP_STATS.reduced(unit, transport.name, sum(piece.numel() for piece in dense) * itemsize)

    def finish() -> torch.Tensor:
        wait_work(marks_work, group, stamp)
        union = marks.bool().split([region.rows for region in regions])
        indices = [torch.nonzero(touched).squeeze(1) for touched in union]
        rows = [region.of(flat).index_select(0, index) for region, index in zip(regions, indices, strict=True)]
        rows_sum = transport.all_reduce([r.reshape(-1) for r in rows], flat.dtype, stamp)
        STEP_STATS.reduced(unit, transport.name, sum(r.numel() for r in rows) * itemsize)
        if dense_sum is not None:
            torch._foreach_copy_(dense, list(dense_sum.wait().split([piece.numel() for piece in dense])))
        summed, start = rows_sum.wait(), 0
        for region, index, row in zip(regions, indices, rows, strict=True):  # the other rows: zeros already
            region.of(flat).index_copy_(0, index, summed[start : start + row.numel()].view_as(row))
            start += row.numel()
        return flat

    return Pending(finish)


def _dense_pieces(flat: torch.Tensor, regions: list[RowRegion]) -> list[torch.Tensor]:
    """The parts of ``flat`` outside ``regions`` (sorted by offset), as views."""
    pieces, start = [], 0
    for region in sorted(regions):
        if region.offset > start:
            pieces.append(flat[start : region.offset])
        start = region.offset + region.rows * region.row_numel
    if start < flat.numel():
        pieces.append(flat[start:])
    return pieces
