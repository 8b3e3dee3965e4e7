"""Stateless copies around a unit's collectives, shared by every transport: pack, unpack, sum of rows.

A unit's collective moves ONE flat buffer, packed from all its parameters (the FSDP paper's FlatParameter): the
packing copy is also the cast to the collective's dtype under mixed precision.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RankRows(NamedTuple):
    """A gradient on its way to a reduce-scatter: ``flat`` (the full gradient, rank-major) stands for its zero-padded
    (world_size, columns) view, row r going to rank r.

    Why not that view itself: a parameter whose rows do not divide by the world size (a 50257-token embedding on 2
    ranks) would need a padded copy of its whole gradient first -- a second full gradient alive at the peak of
    backward, and one more pass over it. ``pack_rows`` writes the padding straight into the send buffer instead. An
    empty ``flat`` stands for a gradient that never arrived (all zeros).

    ``row_numel``: non-zero for a gradient that is zero in most of its rows of that many elements (an untied
    embedding's, ``FSDPParam.rows_sparse``), which a reduction between hosts may send by its touched rows.
    """

    flat: torch.Tensor
    columns: int
    row_numel: int = 0

    def touched_rows(self, world_size: int) -> torch.Tensor:
        """One byte per row of the padded (world_size * columns / row_numel) rows: 1 where the row is non-zero."""
        marks = torch.zeros(world_size * self.columns // self.row_numel, dtype=torch.uint8, device=self.flat.device)
        if self.flat.numel():
            rows = self.flat.view(-1, self.row_numel)
            marks[: rows.size(0)] = nonzero_rows(rows)
        return marks


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nonzero_rows(rows: torch.Tensor) -> torch.Tensor:
    """One bool per row of the 2-D ``rows``: whether any of its elements has a bit set.

    Read as integers of the same width, a row is tested in one pass (``!= 0`` first writes a boolean tensor the size
    of the rows). A row of -0.0 counts as touched: it is then sent, and adds nothing."""
    return torch.any(rows.view(_SAME_WIDTH_INT[rows.element_size()]), dim=1)


def pack(tensors: list[torch.Tensor], out: torch.Tensor, start: int = 0) -> None:
    """Concatenate 1-D ``tensors`` into the 1-D ``out`` (a unit's shards, or its replicated gradients), casting to
    ``out``'s dtype; from element ``start`` of the concatenation on, as many as ``out`` holds (one chunk of a
    collective streamed through a bounded slot: see [Note: chunks] in ``transport/shm/slots.py``)."""
    if start or out.numel() != sum(t.numel() for t in tensors):
        parts = window([t.numel() for t in tensors], start, start + out.numel())
        tensors = [tensors[index][lo:hi] for index, lo, hi, _ in parts]
    if all(t.dtype == out.dtype for t in tensors):
        torch.cat(tensors, out=out)
    else:  # mixed precision: the cast is the packing copy
        torch._foreach_copy_(list(out.split([t.numel() for t in tensors])), tensors)


def window(sizes: list[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """The parts of ``[start, stop)`` of ``sizes`` laid side by side: ``(index, lo, hi, offset)`` for every part
    ``index`` that overlaps it, its own ``[lo, hi)`` and where that begins inside the window."""
    parts, begin = [], 0
    for index, size in enumerate(sizes):
        lo, hi = max(start - begin, 0), min(stop - begin, size)
        if lo < hi:
            parts.append((index, lo, hi, begin + lo - start))
        begin += size
    return parts


def pack_rows(grads: list[RankRows], out: torch.Tensor, start: int = 0) -> None:
    """Lay ``grads`` side by side into ``out`` (world_size, columns; any row stride), zero-padded, casting to
    ``out``'s dtype: row r of ``out`` is what rank r receives. ``start``: the first column of the side-by-side
    layout that ``out`` holds (a chunk; see [Note: chunks] in ``transport/shm/slots.py``)."""
    world_size = out.size(0)
    whole = start == 0 and out.size(1) == sum(grad.columns for grad in grads)
    if whole and all(grad.flat.numel() == world_size * grad.columns for grad in grads):  # one fused copy
        torch.cat([grad.flat.view(world_size, grad.columns) for grad in grads], dim=-1, out=out)
        return
    for index, lo, hi, offset in window([grad.columns for grad in grads], start, start + out.size(1)):
        grad = grads[index]
        _copy_zero_padded(grad.flat, grad.columns, lo, out[:, offset : offset + hi - lo])


def _copy_zero_padded(flat: torch.Tensor, columns: int, lo: int, block: torch.Tensor) -> None:
    """Columns ``[lo, lo + block's width)`` of ``flat`` viewed row-major as (rows, ``columns``) into ``block``,
    zeros after its end."""
    width = block.size(1)
    whole, rest = divmod(flat.numel(), columns)
    block[:whole].copy_(flat[: whole * columns].view(whole, columns)[:, lo : lo + width])
    if rest:
        arrived = max(min(rest - lo, width), 0)
        tail = flat[whole * columns + lo : whole * columns + lo + arrived]
        block[whole, :arrived].copy_(tail)
        block[whole, arrived:].zero_()
        whole += 1
    block[whole:].zero_()


def pack_peer_rows(grads: list[RankRows], out: torch.Tensor, own: int, scale: float, start: int = 0) -> None:
    """``pack_rows`` of every row but ``own``, each multiplied by ``scale`` in the same copy (from column ``start``).

    [Note: the own row stays in the gradient] In a reduce-scatter through memory every rank can read, no rank needs
    the row it keeps itself: packing it would only be copied out again by ``sum_own_row``, which reads it straight
    from the gradients instead (the transport keeps them alive until then). And an average over a power-of-two
    number of ranks is the same to the last bit whether each addend or the sum is divided (a power of two scales
    the exponent alone; only values below the dtype's smallest normal number can round), so the division rides on
    copies made anyway instead of a pass of its own. Together that
    is three passes over a rank's row fewer per reduction: the own row's pack, its copy out, and the divide.
    """
    world_size = out.size(0)
    for index, lo, hi, offset in window([grad.columns for grad in grads], start, start + out.size(1)):
        for row in range(world_size):
            if row != own:
                _scaled_copy_zero_padded(row_of(grads[index], row)[lo:hi], out[row, offset : offset + hi - lo], scale)


def sum_own_row(
    grads: list[RankRows], own: int, peers: list[torch.Tensor], scale: float, out: torch.Tensor, start: int = 0
) -> None:
    """``out``: this rank's row of the sum over ranks, from ``peers`` (row ``own`` of every other rank's buffer,
    packed by ``pack_peer_rows``) and row ``own`` of ``grads`` themselves, multiplied by ``scale`` as it is added.

    See [Note: the own row stays in the gradient]. ``peers`` is never empty (a reduction has two ranks at least).
    ``start``: the first column of the side-by-side layout that ``out`` and ``peers`` hold (a chunk).
    """
    for index, lo, hi, offset in window([grad.columns for grad in grads], start, start + out.numel()):
        columns = slice(offset, offset + hi - lo)
        mine, dest, theirs = row_of(grads[index], own)[lo:hi], out[columns], [peer[columns] for peer in peers]
        arrived = mine.numel()  # short or empty: the zero padding of the last rows, or a gradient that never came
        torch.add(theirs[0][:arrived], mine, alpha=scale, out=dest[:arrived])
        dest[arrived:].copy_(theirs[0][arrived:])
        for peer in theirs[1:]:
            dest.add_(peer)


def row_of(grad: RankRows, row: int) -> torch.Tensor:
    """Row ``row`` of the gradient's zero-padded (world_size, columns) view, without its padding (short or empty)."""
    numel = grad.flat.numel()
    start = min(row * grad.columns, numel)
    return grad.flat[start : min(start + grad.columns, numel)]


def _scaled_copy_zero_padded(source: torch.Tensor, dest: torch.Tensor, scale: float) -> None:
    """``source * scale`` into the start of the 1-D ``dest`` (casting to its dtype), zeros after it."""
    head = dest[: source.numel()]
    if scale == 1.0:
        head.copy_(source)
    else:
        torch.mul(source, scale, out=head)
    dest[source.numel() :].zero_()


def unpack_all_gather(blocks: list[torch.Tensor], shard_numels: list[int], dests: list[torch.Tensor]) -> None:
    """Copy each parameter's rows out of every rank's packed shards into its padded unsharded buffer.

    ``blocks[r]`` (1-D) is the concatenation of every parameter's shard on rank r; the rows of parameter i from rank
    r belong at row r of its padded full tensor viewed as (world_size, shard_numel_i). One fused op per rank.
    """
    rows = [dest.view(len(blocks), -1) for dest in dests]
    for rank, block in enumerate(blocks):
        if all(row.dtype == block.dtype for row in rows):
            out = [row[rank : rank + 1] for row in rows]
            torch.split_with_sizes_copy(block.view(1, -1), shard_numels, dim=1, out=out)
        else:  # rows that crossed hosts in fewer bits (CrossHostPrecision): the copy is the cast back
            for row, part in zip(rows, block.split(shard_numels), strict=True):
                row[rank].copy_(part)


def unpack_gathered_chunk(
    chunk: torch.Tensor, rank: int, start: int, shard_numels: list[int], rows: list[torch.Tensor]
) -> None:
    """``unpack_all_gather`` of one chunk of ``rank``'s packed shards (from element ``start``): each parameter's part
    of it into row ``rank`` of its (world_size, shard_numel) ``rows``."""
    for index, lo, hi, offset in window(shard_numels, start, start + chunk.numel()):
        rows[index][rank, lo:hi].copy_(chunk[offset : offset + hi - lo])


def sum_rows(rows: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The elementwise sum of equal-sized rows, into ``out`` or a new tensor (pairwise adds stream;
    ``sum(dim=0)`` strides). An ``out`` of a wider dtype than the rows accumulates in its own dtype."""
    if len(rows) == 1:
        return rows[0].clone() if out is None else out.copy_(rows[0])
    if out is not None and out.dtype != rows[0].dtype:
        out.copy_(rows[0])
        for row in rows[1:]:
            out.add_(row)
        return out
    result = torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        result.add_(row)
    return result
