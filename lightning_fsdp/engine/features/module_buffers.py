"""The model's buffers (BatchNorm's running statistics, say) as DDP keeps them: one set, rank 0's, on every rank.

[Note: buffers are rank 0's at every checkpoint] Buffers are not sharded: every rank holds all of them, and a
BatchNorm updates its running statistics from its own rank's batch, so ranks fed different data drift apart. DDP
broadcasts rank 0's buffers before every forward (``broadcast_buffers=True``); left alone, a checkpoint would hold
whichever rank's copy its writer took -- rank 0's in the full file, another rank's in the sharded folder (DCP keeps
one copy of a tensor every rank saves, not necessarily rank 0's) -- and resuming or converting the sharded one
changes the model. So both state dict forms broadcast rank 0's buffers first: both checkpoints hold rank 0's, every
rank continues from them, and a resume gives every rank the saved set. The root's first forward in eval mode after
training does the same, so validation on every rank uses the statistics a checkpoint would hold, as under DDP.
Between those points the ranks' statistics drift, as under torch's and Lightning's FSDP: a broadcast before every
forward, as DDP does, costs two collectives (one per dtype) per step -- measured with benchmarks/bench_buffers.py,
see docs/checkpoints.md -- for values no training step reads (BatchNorm normalises with the batch's
own statistics in training). ``SyncBatchNorm`` keeps the statistics equal across ranks at every step anyway.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.runtime.registry import units_under


def broadcast_from_first(tensors: list[torch.Tensor], group: ProcessGroup) -> None:
    """One broadcast per dtype from the group's first rank, the tensors packed flat, copied back in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for tensor in same_dtype:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def broadcast_buffers(module: nn.Module) -> None:
    """Give every rank of the sharded ``module`` the buffers of its first rank (see [Note: buffers are rank 0's at
    every checkpoint]). A collective over the model's ranks; nothing to do for a module without units or buffers.

    Under HYBRID_SHARD the first rank of the replicas' group gives its set to the other replicas first, then every
    shard group's first rank (now holding that set) to its group: every rank ends with the one first rank's buffers.
    """
    units = units_under(module)
    buffers = [b for b in module.buffers() if b.numel() > 0]
    if not units or not buffers:
        return
    for group in (units[0].replicate_group, units[0].shard_group):
        if group is not None and group.size() > 1:
            broadcast_from_first(buffers, group)
