"""A unit's gradient reduction once issued: waiting for it, and handing each parameter its part of the result.

``FSDPUnit.reduce_grads`` packs and issues the one collective (a reduce-scatter of the shards, an all-reduce of
replicated parameters); what comes back is a ``PendingGradReduction`` that the root keeps in flight behind the next
units' backward and finishes later (``RootContext.enqueue_reduction``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

from lightning_fsdp.engine.diagnostics.step_stats import STEP_STATS
from lightning_fsdp.engine.features.sparse_rows import RowRegion
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.whole_tensors import WholeTensors
from lightning_fsdp.engine.transport import Pending

WholeGrads = list[tuple[WholeTensors, list[FSDPParam], list[bool]]]


@dataclass
class PendingGradReduction:
    """A unit's gradient reduction in flight; ``finish`` waits and accumulates the result into the ``.grad``s.

    ``had_grad`` marks, per trainable parameter, whether a gradient arrived on this rank. One that got none (an
    unused parameter) still holds its zero-filled place in the flat buffer, since every rank must send the same
    layout, but keeps ``.grad = None`` as it would unsharded -- so an optimizer skips it instead of applying weight
    decay to it. A parameter used on some ranks and not on others in the same step is not supported (as in
    torch's FSDP): all ranks must take the same branches.
    """

    pending: Pending[torch.Tensor]
    params: list[FSDPParam] | list[nn.Parameter]  # what the reduced buffer holds, in its order
    had_grad: list[bool]
    divide_after: int | None  # fp32 divides the (W-times smaller) result by this, unless the transport divided exactly
    # After ``params``: the segments of whole tensors it holds, each with the parameters packed there and which had
    # a gradient (see [Note: whole tensors] in whole_tensors.py).
    wholes: WholeGrads = field(default_factory=list)

    def finish(self) -> None:
        with record_function("lightning_fsdp.wait_reduce"):
            started = time.perf_counter()
            reduced = self.pending.wait()
            STEP_STATS.blocked_since(started)
            if self.divide_after is not None:  # an average over ranks, as DDP and the unsharded reference compute
                reduced.div_(self.divide_after)
            accept_reduced_grads(reduced, self.params, self.had_grad, self.wholes)


def accept_reduced_grads(
    reduced: torch.Tensor,
    params: list[FSDPParam] | list[nn.Parameter],
    had_grad: list[bool],
    wholes: WholeGrads = (),
) -> None:
    """Hand each of ``params`` (what the reduction packed, in order) that had a gradient its slice of the reduced
    buffer (views: no copy), then the whole tensors this rank holds theirs from its segments."""
    offset = 0
    for param, arrived in zip(params, had_grad, strict=True):
        if isinstance(param, FSDPParam):
            numel = param.layout.shard_numel
            if arrived:
                param.accumulate_sharded_grad(reduced[offset : offset + numel])
        else:
            numel = param.numel()
            if arrived:
                param.grad = reduced[offset : offset + numel].view_as(param).to(param.dtype)
        offset += numel
    for whole, packed, arrived in wholes:
        whole.accept_reduced(reduced[offset : offset + whole.columns], packed, arrived)
        offset += whole.columns


def divide_before_reducing(dtype: torch.dtype, total_world_size: int) -> int | None:
    """Low precision divides by the ranks first, so the sum cannot overflow (the divisor); fp32 divides the result
    after (None), unless the transport divides exactly for free (``Transport.divides_exactly``)."""
    return total_world_size if dtype in (torch.float16, torch.bfloat16) else None


def row_regions(params: list[FSDPParam]) -> list[RowRegion]:
    """Where the row-sparse gradients (``FSDPParam.rows_sparse``) among ``params`` lie in their reduced flat shard."""
    regions, offset = [], 0
    for param in params:
        if param.rows_sparse:
            regions.append(RowRegion(offset, param.layout.chunk_rows, param.layout.row_numel))
        offset += param.layout.shard_numel
    return regions
