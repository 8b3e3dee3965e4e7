"""Stateless copies around a unit's collectives, shared by every transport: pack, unpack, sum of rows.

A unit's collective moves ONE flat buffer, packed from all its parameters (the FSDP paper's FlatParameter): the
packing copy is also the cast to the collective's dtype under mixed precision.
"""

from __future__ import annotations

import torch


def pack(tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Concatenate ``tensors`` along their last dim into ``out`` (any row stride), casting to ``out``'s dtype.

    1-D tensors fill a 1-D ``out`` (a unit's shards, or its replicated gradients); (rows, n_i) tensors fill a
    (rows, sum n_i) ``out`` (its gradients by destination rank).
    """
    if out.dim() == 2 or all(t.dtype == out.dtype for t in tensors):
        torch.cat(tensors, dim=-1, out=out)
    else:  # mixed precision: the cast is the packing copy
        torch._foreach_copy_(list(out.split([t.numel() for t in tensors])), tensors)


def unpack_all_gather(blocks: list[torch.Tensor], shard_numels: list[int], dests: list[torch.Tensor]) -> None:
    """Copy each parameter's rows out of every rank's packed shards into its padded unsharded buffer.

    ``blocks[r]`` (1-D) is the concatenation of every parameter's shard on rank r; the rows of parameter i from rank
    r belong at row r of its padded full tensor viewed as (world_size, shard_numel_i). One fused op per rank.
    """
    rows = [dest.view(len(blocks), -1) for dest in dests]
    for rank, block in enumerate(blocks):
        torch.split_with_sizes_copy(block.view(1, -1), shard_numels, dim=1, out=[row[rank : rank + 1] for row in rows])


def sum_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of equal-sized rows, into a new tensor (pairwise adds stream; ``sum(dim=0)`` strides)."""
    if len(rows) == 1:
        return rows[0].clone()
    result = torch.add(rows[0], rows[1])
    for row in rows[2:]:
        result.add_(row)
    return result
