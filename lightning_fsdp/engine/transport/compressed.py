"""Gloo between hosts with fewer bits on the wire than the computation uses (``CrossHostPrecision``, opt-in).

[Note: fewer bits between hosts] Across a link every byte costs time, inside a host almost none, so the precision
is lowered where the bytes cross hosts only: this transport carries the group between hosts (HYBRID's replicas, the
ranks of a FULL_SHARD group with one rank a host, the column stage of the hierarchical collectives), and shared memory
inside each host keeps full precision.

- Gathers in bf16: the packing copy casts, the unpacking copy casts back; every rank's rows (its own included) are
  the rounded ones, so every rank computes with the same parameters.
- Gathers in int8: see [Note: int8 blocks] in ``int8.py``.
- Reduce-scatters in bf16: each rank's rows for the others go as bf16 and are summed in the result's dtype (fp32)
  where they arrive: one rounding per addend, none in the sum.
- All-reduces in bf16 (HYBRID's replicas): over two ranks gloo's bf16 sum adds the two bf16 addends in fp32 and rounds
  once, the same as above; over more, a reduce-scatter summed in fp32 then a bf16 all-gather of the sums, so that
  every replica holds the same rounded values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.diagnostics.hang_watch import wait_work
from lightning_fsdp.engine.options import CrossHostPrecision
from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.base import Pending
from lightning_fsdp.engine.transport.framing import all_gather_flat, frame_bytes
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.int8 import decode_int8, encode_int8, int8_frame_bytes
from lightning_fsdp.engine.transport.packing import RankRows


class LinkTransport(GlooTransport):
    """``GlooTransport`` whose collectives cross hosts in ``precision``'s formats where they are narrower."""

    def __init__(self, group: ProcessGroup, precision: CrossHostPrecision) -> None:
        super().__init__(group, between_hosts=True)
        self.precision = precision
        self.name = f"gloo ({_describe(precision)} between hosts)"

    def all_gather_into(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        if self.precision.gather == "int8" and dtype.is_floating_point:
            return self._all_gather_int8(shards, dtype, stamp, dests)
        return super().all_gather_into(shards, _narrower(self.precision.gather_dtype, dtype), stamp, dests)

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        return self._reduce_scatter(grads, _narrower(self.precision.reduce_dtype, dtype), stamp, divide_by, dtype)

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        wire = _narrower(self.precision.reduce_dtype, dtype)
        if wire == dtype:
            return super().all_reduce(grads, dtype, stamp, divide_by)
        if self.world_size == 2:  # see [Note: fewer bits between hosts]
            summed = super().all_reduce(grads, wire, stamp, divide_by)
            return Pending(lambda: summed.wait().to(dtype))
        numel = sum(grad.numel() for grad in grads)
        columns = -(-numel // self.world_size)
        flat = torch.empty(numel, dtype=dtype, device=grads[0].device)
        packing.pack(grads, flat)
        part = self._reduce_scatter([RankRows(flat, columns)], wire, stamp, divide_by, dtype)

        def finish() -> torch.Tensor:
            out = torch.empty(self.world_size * columns, dtype=dtype, device=flat.device)
            GlooTransport.all_gather_into(self, [part.wait()], wire, stamp, [out]).wait()
            return out[:numel]

        return Pending(finish)

    def _all_gather_int8(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """See [Note: int8 blocks] in ``int8.py``: one frame a rank, the encoded shards then the stamp."""
        world_size, pool = self.world_size, self.pool
        flat = [shard.reshape(-1) for shard in shards]
        shard_numels = [shard.numel() for shard in flat]
        numel = sum(shard_numels)
        data_bytes = int8_frame_bytes(numel)
        frame = frame_bytes(data_bytes, stamp)
        values = torch.empty(numel, dtype=torch.float32, device=flat[0].device)
        packing.pack(flat, values)
        send = pool.take(frame, torch.uint8, values.device)
        encode_int8(values, send[:data_bytes])
        if stamp is not None:
            send[data_bytes:].copy_(stamp.as_bytes())
        output = pool.take(world_size * frame, torch.uint8, values.device)
        work = all_gather_flat(output, send, group=self.group, async_op=True)
        rows = [dest.view(world_size, -1) for dest in dests]

        def finish() -> None:
            wait_work(work, self.group, stamp)
            frames = output.view(world_size, frame)
            if stamp is not None:
                stamp.verify_bytes(frames[:, data_bytes:], self.group)
            for rank in range(world_size):
                decoded = decode_int8(frames[rank, :data_bytes], numel, dtype)
                packing.unpack_gathered_chunk(decoded, rank, 0, shard_numels, rows)
            pool.give(send)
            pool.give(output)

        return Pending(finish)


def _narrower(wire: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """``wire`` where it has fewer bytes than ``dtype`` (a bf16 run is not widened), else ``dtype``."""
    return wire if wire is not None and wire.itemsize < dtype.itemsize else dtype


def _describe(precision: CrossHostPrecision) -> str:
    return f"gathers {precision.gather or 'exact'}, reductions {precision.reduce or 'exact'}"


def link_transport(group: ProcessGroup, precision: CrossHostPrecision | None) -> GlooTransport:
    """The transport of a group whose ranks talk across hosts only: gloo, narrowed by ``precision`` if given."""
    if precision is None:
        return GlooTransport(group, between_hosts=True)
    if dist.get_backend(group) != dist.Backend.GLOO:
        raise ValueError(
            f"cross_host_precision needs gloo between hosts (CPU ranks), not {dist.get_backend(group)}; drop it."
        )
    return LinkTransport(group, precision)
