"""The collectives of CPU ranks over gloo's asynchronous work handles: the transport between hosts.

[Note: reduce-scatter on gloo] gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input plus
copies, moving twice the bytes a reduce-scatter needs. An ``all_to_all_single`` that sends rank r the r-th slice
of every rank's input, followed by a local sum, moves exactly the reduce-scatter minimum ((W - 1)/W of the
input per rank) and runs asynchronously on gloo's worker threads, so on gloo we build the reduce-scatter that way.

[Note: stamps in the frames] Every rank's part of a collective is a *frame*: the data, then the collective's stamp
(``STAMP_BYTES``; see [Note: collective identity] in ``ledger.py``). An all-gather and an all-to-all move raw bytes,
so the frames travel as uint8 and the data is viewed in its dtype on both sides; after the wait every rank compares
the stamps it received with its own. An all-reduce sums, so it carries the stamp's digest bits instead. The check
costs a few bytes per collective, not a collective of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_fsdp.engine import collectives
from lightning_fsdp.engine.collectives import RankRows
from lightning_fsdp.engine.ledger import DIGEST_BITS, STAMP_BYTES, Stamp
from lightning_fsdp.engine.transport import Pending, Transport

# torch 2.13 renamed the flat-tensor all-gather; older releases only have the old name.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def frame_bytes(data_bytes: int, stamp: Stamp | None) -> int:
    """Bytes of one rank's frame: its data, then its stamp (see [Note: stamps in the frames])."""
    return data_bytes + (STAMP_BYTES if stamp is not None else 0)


class GlooTransport(Transport):
    """All-gather and all-to-all over gloo's worker threads, which overlap the training thread's compute."""

    name = "gloo"

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        pool, world_size = self.pool, self.world_size
        data_bytes = sum(shard.numel() for shard in shards) * dtype.itemsize
        frame = frame_bytes(data_bytes, stamp)
        send = pool.take(frame, torch.uint8, shards[0].device)
        collectives.pack([shard.reshape(-1) for shard in shards], send[:data_bytes].view(dtype))
        if stamp is not None:
            send[data_bytes:].copy_(stamp.as_bytes())
        output = pool.take(world_size * frame, torch.uint8, send.device)
        work = all_gather_flat(output, send, group=self.group, async_op=True)

        def finish() -> list[torch.Tensor]:
            work.wait()
            frames = output.view(world_size, frame)
            if stamp is not None:
                stamp.verify_bytes(frames[:, data_bytes:], self.group)
            return [frames[rank, :data_bytes].view(dtype) for rank in range(world_size)]

        def release() -> None:
            pool.give(send)
            pool.give(output)

        return Pending(finish, release)

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        """See [Note: reduce-scatter on gloo]."""
        pool, world_size = self.pool, self.world_size
        data_bytes = sum(grad.columns for grad in grads) * dtype.itemsize
        frame = frame_bytes(data_bytes, stamp)
        send = pool.take(world_size * frame, torch.uint8, grads[0].flat.device).view(world_size, frame)
        data = send[:, :data_bytes].view(dtype)
        collectives.pack_rows(grads, data)
        if divide_by is not None:
            data.div_(divide_by)
        if stamp is not None:
            send[:, data_bytes:].copy_(stamp.as_bytes().expand(world_size, -1))
        received = pool.take(world_size * frame, torch.uint8, send.device).view(world_size, frame)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            if stamp is not None:
                stamp.verify_bytes(received[:, data_bytes:], self.group)
            result = collectives.sum_rows(list(received[:, :data_bytes].view(dtype).unbind(0)))
            pool.give(send)
            pool.give(received)
            return result

        return Pending(finish)

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        flat = torch.empty(numel + (DIGEST_BITS if stamp is not None else 0), dtype=dtype, device=grads[0].device)
        collectives.pack(grads, flat[:numel])
        if divide_by is not None:
            flat[:numel].div_(divide_by)
        if stamp is not None:
            flat[numel:].copy_(stamp.digest(dtype))
        work = dist.all_reduce(flat, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            if stamp is not None:
                stamp.verify_digest(flat[numel:], self.world_size)
            return flat[:numel]

        return Pending(finish)
