"""Reuse of the large temporaries of a unit's collectives across units and steps (CPU only).

[Note: why pool on CPU] Every unshard and every reduction needs buffers of a unit's full size: the all-gather
output, the reduce send buffer and, on gloo, the all-to-all receive buffer. A fresh CPU allocation of that size is an
``mmap`` whose pages fault in on first touch: measured here, allocating and filling 24 MB takes ~7 ms against ~1 ms
for refilling warm memory, and a step of the 25M-parameter benchmark model allocates about fifty such buffers. So
these temporaries (never the parameters, whose memory must really be given back) come from a small pool keyed by
size: the transformer's blocks all share one size, so one or two buffers serve every unit. The pool is emptied at
the end of each backward, so between steps a rank holds its shards and nothing else. On CUDA the caching
allocator already does this, and reuse across streams would need stream bookkeeping, so the pool stays off.
"""

from __future__ import annotations

import torch

# Enough for the buffers of two units in flight at once (a reduction overlapping the next unit's gather).
MAX_FREE_PER_SIZE = 2
# Chunk buffers kept across steps, per size: what a step has in flight at once (two chunks of a gather and of the
# one behind it, two of a reduction and of the one behind it), so a step allocates none of them.
MAX_KEPT_PER_SIZE = 8


class BufferPool:
    """Free buffers by (numel, dtype, device). ``retain=False`` makes a pool that only allocates (no root yet).

    Buffers given back with ``keep=True`` (the fixed-size chunk buffers of a collective streamed in chunks, see
    [Note: chunks over gloo] in ``gloo.py``) survive ``clear``: like DDP's buckets they are a bounded amount of memory
    held for the whole run, where buffers of a unit's size are given back at the end of every step.
    """

    def __init__(self, retain: bool = True) -> None:
        self.retain = retain
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._kept: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements with arbitrary contents."""
        for shelf in (self._kept, self._free):
            free = shelf.get((numel, dtype, device))
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor, keep: bool = False) -> None:
        """Return a buffer no collective and no tensor view will touch again (``keep``: across ``clear`` too)."""
        if not self.retain or tensor.device.type != "cpu":
            return
        shelf, most = (self._kept, MAX_KEPT_PER_SIZE) if keep else (self._free, MAX_FREE_PER_SIZE)
        free = shelf.setdefault((tensor.numel(), tensor.dtype, tensor.device), [])
        if len(free) < most:
            free.append(tensor.view(-1))

    def clear(self) -> None:
        """The end of a step: every buffer but the kept chunk buffers goes back to the allocator."""
        self._free.clear()

    def clear_all(self) -> None:
        """The end of the run: the kept chunk buffers go back too."""
        self._free.clear()
        self._kept.clear()
