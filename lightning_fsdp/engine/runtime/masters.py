"""A unit's master weights (or their gradients) gathered whole, in their own dtype, outside the training step: for
full state dicts, ``summon_full_params``, and moving parameters to the ranks that hold them whole."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.whole_tensors import WholeTensors
from lightning_fsdp.engine.transport.framing import all_gather_flat


def gather_masters(params: list[FSDPParam], wholes: list[WholeTensors] = ()) -> list[tuple[FSDPParam, torch.Tensor]]:
    """Every parameter's full tensor in its shards' own dtype: one all-gather of the unit's packed shards.

    The shards are packed as the forward's all-gather packs them (padded, rank-major), so parameter ``i``'s rows
    from rank ``r`` lie at row ``r`` of the output viewed as (world_size, packed numel); a tensor held whole lies in
    its owner's row (see [Note: whole tensors] in ``whole_tensors.py``). A parameter kept whole on every rank (no
    shard group, or a group of one) is its shard.
    """
    alone = [(p, p.sharded.detach().view(p.shape)) for p in params if p.group is None or p.layout.world_size == 1]
    rows = [p for p in params if p.group is not None and p.layout.world_size > 1 and p.layout.owner is None]
    if not rows and not wholes:
        return alone
    by_rank = _gather_rank_major(
        [p.padded_shard.reshape(-1) for p in rows] + [whole.padded_shard for whole in wholes],
        (rows or wholes[0].params)[0].group,
    )
    return alone + _unpack(by_rank, rows, wholes)


def gather_grads(params: list[FSDPParam]) -> list[torch.Tensor | None]:
    """The full gradient of each of ``params`` (spread over the ranks by rows) from every rank's ``.grad``; None for
    a parameter no rank has a gradient for. A collective over their shard group."""
    group = params[0].group
    had = torch.tensor([p.sharded.grad is not None for p in params], dtype=torch.uint8)
    dist.all_reduce(had, op=dist.ReduceOp.MAX, group=group)
    wanted = [p for p, got in zip(params, had.tolist(), strict=True) if got]
    if not wanted:
        return [None] * len(params)
    by_rank = _gather_rank_major([_padded(p, lambda q: q.sharded.grad) for p in wanted], group)
    grads = dict(_unpack(by_rank, wanted, []))
    return [grads.get(p) for p in params]


def _padded(fsdp_param: FSDPParam, value_of: Callable[[FSDPParam], torch.Tensor | None]) -> torch.Tensor:
    """This rank's rows of a per-row value of ``fsdp_param`` (zeros where it has none), padded as its shard is."""
    padded = torch.zeros(
        fsdp_param.layout.shard_numel, dtype=fsdp_param.sharded.dtype, device=fsdp_param.compute_device
    )
    value = value_of(fsdp_param)
    if value is not None and value.numel():
        padded[: value.numel()].copy_(fsdp_param.flat(value.detach()))
    return padded


def _gather_rank_major(pieces: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    send = torch.cat(pieces)
    world_size = group.size()
    output = send.new_empty(world_size * send.numel())
    all_gather_flat(output, send, group=group)
    return output.view(world_size, -1)


def _unpack(
    by_rank: torch.Tensor, rows: list[FSDPParam], wholes: list[WholeTensors]
) -> list[tuple[FSDPParam, torch.Tensor]]:
    gathered, offset = [], 0
    for p in rows:
        numel = p.layout.shard_numel
        flat = by_rank[:, offset : offset + numel].reshape(-1)[: p.layout.rows * p.layout.row_numel]
        gathered.append((p, p.laid_out(flat, p.shape)))
        offset += numel
    for whole in wholes:
        gathered += whole.full_values(by_rank[:, offset : offset + whole.columns].reshape(-1))
        offset += whole.columns
    return gathered
