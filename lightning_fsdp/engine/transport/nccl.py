"""The collectives of CUDA ranks: NCCL's flat all-gather and reduce-scatter on streams of their own.

Communication runs on two side streams, ordered against the compute stream by events rather than by synchronising the
host (see [Note: streams and the free discipline] above ``NcclTransport``). Stamps travel in the frames as on gloo (see
[Note: stamps in the frames] in ``gloo.py``; the reduce-scatter sums, so it carries the digest bits), but reading them
would synchronise the host with the device at every collective, so they are checked once per step, in ``end_step``.

Without CUDA (a gloo group on CPU) the same code runs with no side streams: that is how its data path is tested on
machines without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.base import Pending, Transport
from lightning_fsdp.engine.transport.framing import all_gather_flat, frame_bytes
from lightning_fsdp.engine.transport.identity import DIGEST_BITS, Stamp
from lightning_fsdp.engine.transport.packing import RankRows

# torch 2.13 renamed the flat-tensor reduce-scatter; older releases only have the old name.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# [Note: streams and the free discipline] As in torch FSDP2, communication runs on two side streams so that it overlaps
# the compute stream, ordered by events rather than by synchronising the host:
#
# - All-gather: the gather stream first waits for the compute stream (the optimizer wrote the shards there), then packs
#   the shards (the copy-in runs on the gather stream, off the compute stream) and gathers into an output it allocated,
#   and records an event. ``wait`` makes the compute stream wait for that event; the caller copies out on the compute
#   stream. The send and output buffers belong to the gather stream's memory pool, so they must not be freed (and reused
#   by the next gather) while the compute stream still reads them: ``release`` records an event on the compute stream
#   after the copy-out, and the *next* all-gather makes the gather stream wait for it before dropping the buffers. No
#   ``record_stream``, whose frees are deferred by the allocator until the host syncs.
# - Reduce-scatter and all-reduce: the gradients are packed on the compute stream (where autograd produced them), so
#   they can be freed as soon as the packing is issued; the reduce stream waits for the compute stream, reduces, and
#   records an event. The send buffer and the output were allocated on the compute stream and the pending collective
#   keeps them alive until ``wait`` has made the compute stream wait for the event: every later use or free of them on
#   the compute stream is ordered after the collective.
class NcclTransport(Transport):
    """``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on an all-gather and a reduce stream of their own."""

    name = "NCCL"

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        super().__init__(group)
        self.device = device
        cuda = device.type == "cuda"
        self.gather_stream = torch.cuda.Stream(device) if cuda else None
        self.reduce_stream = torch.cuda.Stream(device) if cuda else None
        # Gathered buffers the compute stream has read, with the event recorded after that read.
        self._released_gathers: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        self._unchecked: list[Callable[[], None]] = []  # stamp checks, run at the end of the step

    # ----- streams (none without CUDA) ---------------------------------------------------------------------------

    def _compute_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.gather_stream is not None else None

    @staticmethod
    @contextlib.contextmanager
    def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    @staticmethod
    def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        return stream.record_event() if stream is not None else None

    @staticmethod
    def _wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def _free_released_gathers(self) -> None:
        """See [Note: streams and the free discipline]: the gather stream passes every read, then drops the buffers."""
        for _send, _output, read in self._released_gathers:
            self._wait(self.gather_stream, read)
        self._released_gathers.clear()

    # ----- the collectives ---------------------------------------------------------------------------------------

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        world_size, compute = self.world_size, self._compute_stream()
        data_bytes = sum(shard.numel() for shard in shards) * dtype.itemsize
        frame = frame_bytes(data_bytes, stamp)
        self._free_released_gathers()
        if self.gather_stream is not None:
            self.gather_stream.wait_stream(compute)
        with self._on(self.gather_stream):
            send = torch.empty(frame, dtype=torch.uint8, device=self.device)
            packing.pack([shard.reshape(-1) for shard in shards], send[:data_bytes].view(dtype))
            if stamp is not None:
                send[data_bytes:].copy_(stamp.as_bytes(), non_blocking=True)
            output = torch.empty(world_size * frame, dtype=torch.uint8, device=self.device)
            all_gather_flat(output, send, group=self.group)
            gathered = self._record(self.gather_stream)

        def finish() -> list[torch.Tensor]:
            self._wait(compute, gathered)
            frames = output.view(world_size, frame)
            if stamp is not None:
                stamps = frames[:, data_bytes:].clone()
                self._unchecked.append(lambda: stamp.verify_bytes(stamps.cpu(), self.group))
            return [frames[rank, :data_bytes].view(dtype) for rank in range(world_size)]

        def release() -> None:
            self._released_gathers.append((send, output, self._record(compute)))

        return Pending(finish, release)

    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        world_size, columns = self.world_size, sum(grad.columns for grad in grads)
        extra = DIGEST_BITS if stamp is not None else 0
        send = torch.empty(world_size, columns + extra, dtype=dtype, device=self.device)
        packing.pack_rows(grads, send[:, :columns])
        if divide_by is not None:
            send[:, :columns].div_(divide_by)
        if stamp is not None:
            send[:, columns:].copy_(stamp.digest(dtype).expand(world_size, -1), non_blocking=True)
        output = torch.empty(columns + extra, dtype=dtype, device=self.device)
        return self._reduce(
            lambda: reduce_scatter_flat(output, send.view(-1), group=self.group), send, output, columns, stamp
        )

    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        flat = torch.empty(numel + (DIGEST_BITS if stamp is not None else 0), dtype=dtype, device=self.device)
        packing.pack(grads, flat[:numel])
        if divide_by is not None:
            flat[:numel].div_(divide_by)
        if stamp is not None:
            flat[numel:].copy_(stamp.digest(dtype), non_blocking=True)
        return self._reduce(lambda: dist.all_reduce(flat, group=self.group), flat, flat, numel, stamp)

    def _reduce(
        self,
        collective: Callable[[], object],
        send: torch.Tensor,
        output: torch.Tensor,
        numel: int,
        stamp: Stamp | None,
    ) -> Pending[torch.Tensor]:
        """Run a summing ``collective`` on the reduce stream; see [Note: streams and the free discipline]."""
        compute = self._compute_stream()
        held = [send]  # until the compute stream waited for the collective
        if self.reduce_stream is not None:
            self.reduce_stream.wait_stream(compute)
        with self._on(self.reduce_stream):
            collective()
            reduced = self._record(self.reduce_stream)

        def finish() -> torch.Tensor:
            self._wait(compute, reduced)
            if stamp is not None:
                digest = output[numel:].clone()
                self._unchecked.append(lambda: stamp.verify_digest(digest.cpu(), self.world_size))
            held.clear()
            return output[:numel]

        return Pending(finish)

    def end_step(self) -> None:
        """Check the step's stamps (one host sync per collective, once the step's compute is queued)."""
        super().end_step()
        checks, self._unchecked = self._unchecked, []
        for check in checks:
            check()

    def close(self) -> None:
        """The gathered buffers go, after the reads ordered before them; a step that did not end leaves its stamp
        checks unrun."""
        super().close()
        self._free_released_gathers()
        self._unchecked = []
