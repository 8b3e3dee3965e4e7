"""The collectives of CPU ranks over gloo's asynchronous work handles: the transport between hosts.

Every rank's part of a collective travels with the collective's stamp, checked after the wait (see
[Note: stamps in the frames]). On one host a reduce-scatter is an all-to-all plus a local sum, a large one in bounded
chunks; a unit's gather, and between hosts (``between_hosts``) a reduce-scatter too, is point-to-point messages
received straight where they belong, all in flight at once, so that a link always has a queue. Each of these has its
Note beside the code below: [Note: reduce-scatter on gloo], [Note: chunks over gloo], [Note: chunks between hosts],
[Note: gathers point to point], [Note: reductions between hosts point to point] and
[Note: an embedding's rows in a reduce-scatter].
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.diagnostics.hang_watch import wait_work
from lightning_fsdp.engine.transport import packing
from lightning_fsdp.engine.transport.base import (
    PIPELINE,
    Pending,
    Transport,
    announce,
    chunk_limit,
    messages_of_a_collective,
    payload,
)
from lightning_fsdp.engine.transport.framing import all_gather_flat, frame_bytes
from lightning_fsdp.engine.transport.identity import DIGEST_BITS, STAMP_BYTES, Stamp
from lightning_fsdp.engine.transport.packing import RankRows

UNSTAMPED_TAGS = 2**20  # tags of the messages of collectives no root numbers: a counter modulo this


class SparseRows(NamedTuple):
    """A row-sparse gradient in a reduce-scatter between hosts: ``rows`` rows of ``row_numel`` a rank, the row for
    each peer (its source) and the buffer each peer's row of this rank's arrives in."""

    rows: int
    row_numel: int
    to_peers: dict[int, torch.Tensor]
    from_peers: dict[int, torch.Tensor]


# [Note: stamps in the frames] Every rank's part of a collective is a *frame*: the data, then the collective's stamp
# (``STAMP_BYTES``; see [Note: collective identity] in ``identity.py``). An all-gather and an all-to-all move raw bytes,
# so the frames travel as uint8 and the data is viewed in its dtype on both sides; after the wait every rank compares
# the stamps it received with its own. An all-reduce sums, so it carries the stamp's digest bits instead. The check
# costs a few bytes per collective, not a collective of its own.
class GlooTransport(Transport):
    """All-gather and all-to-all over gloo's worker threads, which overlap the training thread's compute."""

    name = "gloo"

    def __init__(self, group: ProcessGroup, between_hosts: bool = False) -> None:
        super().__init__(group)
        self.crosses_hosts = self.gathers_rows = between_hosts
        # Chunks in flight at once: see [Note: chunks over gloo] and [Note: chunks between hosts].
        self.chunks_in_flight = None if between_hosts else PIPELINE
        self._untagged = 0

    def all_gather(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None
    ) -> Pending[list[torch.Tensor]]:
        pool, world_size = self.pool, self.world_size
        data_bytes = sum(shard.numel() for shard in shards) * dtype.itemsize
        frame = frame_bytes(data_bytes, stamp)
        send = pool.take(frame, torch.uint8, shards[0].device)
        packing.pack([shard.reshape(-1) for shard in shards], send[:data_bytes].view(dtype))
        if stamp is not None:
            send[data_bytes:].copy_(stamp.as_bytes())
        output = pool.take(world_size * frame, torch.uint8, send.device)
        work = all_gather_flat(output, send, group=self.group, async_op=True)

        def finish() -> list[torch.Tensor]:
            wait_work(work, self.group, stamp)
            frames = output.view(world_size, frame)
            if stamp is not None:
                stamp.verify_bytes(frames[:, data_bytes:], self.group)
            return [frames[rank, :data_bytes].view(dtype) for rank in range(world_size)]

        def release() -> None:
            pool.give(send)
            pool.give(output)

        return Pending(finish, release)

    # [Note: gathers point to point] gloo's all-gather receives into a flat tensor of its own and copies it into the
    # output, which we then unpack into each parameter's rows: two copies of the whole unit on top of the packing, on
    # cores the ranks compute on. Point-to-point messages land where the receiver says: each rank sends every
    # parameter's shard as it is to every peer (in pieces of at most ``chunk_limit()`` bytes, so a language model's
    # embedding never travels as one message) and receives each peer's straight into that peer's row of the unsharded
    # buffer. The bytes per rank are a ring's ((W - 1)/W of the unit), nothing is packed or unpacked, and every message
    # is in flight at once, which keeps a link's queue full. Receives are posted before sends: gloo sends a message only
    # once its receiver has said it is ready, and that notice travels on the same connection as this rank's own data, so
    # posted after the sends it would wait behind them and the two directions of the link would take turns. Under mixed
    # precision the shards are packed once, cast, and the own row copied from the cast; rows of a wider dtype than the
    # wire (``CrossHostPrecision``) arrive in a buffer and are cast where they are unpacked.
    #
    # The messages' tag is the collective's identity (``Stamp.tag``), so a message can only be received by the same
    # collective on its peer: gloo aborts the process when a message is longer than the buffer posted for it, and fills
    # a longer one only in part, silently. A point-to-point work of gloo cannot be waited for in slices, though:
    # ``is_completed`` stays False until it is waited for, and a wait whose timeout passes closes the connection to the
    # peer. So the ranks' stamps travel beside the messages in an all-gather of their own (32 bytes a rank), the wait
    # that ``wait_work`` polls, interrupts and explains; once it is over every rank is in this collective (or has raised
    # ``CollectiveMismatchError``), its messages are on their way, and they are waited for outright. The gather is
    # announced to the collective hooks as the one all-gather it stands for; its messages and the stamps' gather are not
    # counted (``messages_of_a_collective``).
    def all_gather_into(
        self, shards: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, dests: list[torch.Tensor]
    ) -> Pending[None]:
        """Point to point, straight into ``dests`` (see [Note: gathers point to point])."""
        world_size, rank = self.world_size, self.rank
        flat = [shard.reshape(-1) for shard in shards]
        shard_numels = [shard.numel() for shard in flat]
        rows = [dest.view(world_size, -1) for dest in dests]
        device, numel = flat[0].device, sum(shard_numels)
        packed = None
        if any(shard.dtype != dtype for shard in flat):  # mixed precision: the packing copy is the cast
            packed = self.pool.take(numel, dtype, device)
            packing.pack(flat, packed)
        sources = flat if packed is None else list(packed.split(shard_numels))
        direct = all(row.dtype == dtype for row in rows)  # else rows wider than the wire (CrossHostPrecision)
        arrivals = {
            peer: self.pool.take(numel, dtype, device) for peer in range(world_size) if peer != rank and not direct
        }
        outgoing = {peer: sources for peer in range(world_size) if peer != rank}
        incoming = {
            peer: [row[peer] for row in rows] if direct else list(arrivals[peer].split(shard_numels))
            for peer in outgoing
        }
        messages = self._exchange(outgoing, incoming, stamp)
        announce("all_gather", "gloo::point_to_point_all_gather", payload((numel,), dtype), world_size)
        for row, source in zip(rows, sources, strict=True):  # every rank's own row is the cast one, as its peers'
            row[rank].copy_(source)

        def finish() -> None:
            messages()
            for peer, arrived in arrivals.items():
                packing.unpack_gathered_chunk(arrived, peer, 0, shard_numels, rows)
                self.pool.give(arrived)
            if packed is not None:
                self.pool.give(packed)

        return Pending(finish)

    def _exchange(
        self,
        outgoing: dict[int, list[torch.Tensor]],
        incoming: dict[int, list[torch.Tensor]],
        stamp: Stamp | None,
        beside: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor | None]:
        """Send ``outgoing[peer]`` to each peer and receive ``incoming[peer]`` from it, every tensor in pieces of at
        most ``chunk_limit()`` bytes, all in flight at once; returns the wait (see [Note: gathers point to point]).
        Both sides must list tensors of the same sizes in the same order: gloo matches a pair's messages in order.
        ``beside`` (uint8, the same size on every rank) travels in the stamps' gather: the wait returns every rank's,
        (world_size, its size)."""
        group, tag, works = self.group, self._tag(stamp), []
        with messages_of_a_collective():
            for peer, tensors in incoming.items():  # first: a receive posted tells its peer it may send
                works += [group.recv([piece], peer, tag) for piece in _pieces(tensors)]
            for peer, tensors in outgoing.items():
                works += [group.send([piece], peer, tag) for piece in _pieces(tensors)]
            # The stamps, by a collective: the one wait here that can be polled (see [Note: gathers point to point]).
            extra = 0 if beside is None else beside.numel()
            identities = torch.empty(self.world_size, STAMP_BYTES + extra, dtype=torch.uint8)
            mine = torch.zeros(STAMP_BYTES + extra, dtype=torch.uint8)
            if stamp is not None:
                mine[:STAMP_BYTES].copy_(stamp.as_bytes())
            if beside is not None:
                mine[STAMP_BYTES:].copy_(beside)
            identity = all_gather_flat(identities.view(-1), mine, group=group, async_op=True)

        def wait() -> torch.Tensor | None:
            wait_work(identity, group, stamp)  # every rank is in this collective: its messages are on their way
            if stamp is not None:
                stamp.verify_bytes(identities[:, :STAMP_BYTES], group)
            for work in works:
                work.wait()
            return identities[:, STAMP_BYTES:] if beside is not None else None

        return wait

    def gather_rows(self, wanted: torch.Tensor, shard: torch.Tensor, full: torch.Tensor, stamp: Stamp | None) -> int:
        """Fill the rows of ``full`` (the padded (world_size * rows, row_numel) tensor) that ``wanted`` marks (one byte
        a row, 1: fill it) from the ranks that hold them; ``shard``: this rank's (rows, row_numel). Every rank of the
        group calls it alike (see [Note: an embedding's rows as they are looked up] in ``embedding_rows.py``): the
        marks ride in the stamps' gather, then each rank sends each peer the rows of its shard that peer wants.
        Returns the rows received from peers."""
        world_size, rank, rows = self.world_size, self.rank, shard.size(0)
        every_rank_wants = self._exchange({}, {}, stamp, beside=wanted)()
        mine = wanted.view(world_size, rows).bool()
        peers = [peer for peer in range(world_size) if peer != rank]
        sends = {peer: [(shard, _marked(every_rank_wants[peer].view(world_size, rows)[rank]))] for peer in peers}
        lands = {peer: [(full[peer * rows : (peer + 1) * rows], _marked(mine[peer]))] for peer in peers}
        received = self._exchange_rows(sends, lands, full.dtype, stamp)
        announce(
            "all_gather", "gloo::point_to_point_gather_rows", payload((received, full.size(1)), full.dtype), world_size
        )
        own = _marked(mine[rank])
        full[rank * rows : (rank + 1) * rows].index_copy_(0, own, shard.index_select(0, own).to(full.dtype))
        return received

    def _exchange_rows(
        self,
        sends: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
        lands: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
        dtype: torch.dtype,
        stamp: Stamp | None,
    ) -> int:
        """Send each peer, in ``dtype``, the rows ``index`` of every (rows, row_numel) ``source`` listed for it as
        ``(source, index)``, and receive from each peer the rows ``index`` of every ``(dest, index)`` listed for it
        (a peer's indices for this rank are this rank's for it, in the same order). Returns the rows received."""
        outgoing = {
            peer: [source.index_select(0, index).to(dtype) for source, index in pairs] for peer, pairs in sends.items()
        }
        incoming = {
            peer: [dest.new_empty(index.numel(), dest.size(1)) for dest, index in pairs]
            for peer, pairs in lands.items()
        }
        self._exchange(outgoing, incoming, stamp)()
        for peer, pairs in lands.items():
            for (dest, index), rows in zip(pairs, incoming[peer], strict=True):
                dest.index_copy_(0, index, rows)
        return sum(index.numel() for pairs in lands.values() for _, index in pairs)

    def _tag(self, stamp: Stamp | None) -> int:
        """The messages' tag: the collective's identity, else the next number (ranks issue collectives in order)."""
        if stamp is not None:
            return stamp.tag()
        self._untagged = (self._untagged + 1) % UNSTAMPED_TAGS
        return self._untagged

    # [Note: reduce-scatter on gloo] gloo implements ``reduce_scatter_tensor`` as an all-reduce of the whole input plus
    # copies, moving twice the bytes a reduce-scatter needs. An ``all_to_all_single`` that sends rank r the r-th slice
    # of every rank's input, followed by a local sum, moves exactly the reduce-scatter minimum ((W - 1)/W of the input
    # per rank) and runs asynchronously on gloo's worker threads, so on gloo we build the reduce-scatter that way.
    def reduce_scatter(
        self, grads: list[RankRows], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        """See [Note: reduce-scatter on gloo]. Between hosts, messages (see [Note: reductions between hosts point to
        point]); on one host, one larger than ``chunk_limit()`` goes in chunks of columns (see [Note: chunks over
        gloo])."""
        return self._reduce_scatter(grads, dtype, stamp, divide_by, dtype)

    def _reduce_scatter(
        self,
        grads: list[RankRows],
        dtype: torch.dtype,
        stamp: Stamp | None,
        divide_by: int | None,
        result_dtype: torch.dtype,
    ) -> Pending[torch.Tensor]:
        """``reduce_scatter`` whose rows travel in ``dtype`` and are summed in ``result_dtype`` where they arrive."""
        if self.crosses_hosts:
            return self._reduce_scatter_point_to_point(grads, dtype, stamp, divide_by, result_dtype)
        pool, world_size = self.pool, self.world_size
        columns = sum(grad.columns for grad in grads)
        per_chunk = _per_chunk(world_size, dtype, stamp)
        if world_size * frame_bytes(columns * dtype.itemsize, stamp) > chunk_limit() and per_chunk > 0:
            return self._reduce_scatter_chunked(grads, columns, per_chunk, dtype, stamp, divide_by, result_dtype)
        data_bytes = columns * dtype.itemsize
        frame = frame_bytes(data_bytes, stamp)
        send = pool.take(world_size * frame, torch.uint8, grads[0].flat.device).view(world_size, frame)
        data = send[:, :data_bytes].view(dtype)
        packing.pack_rows(grads, data)
        if divide_by is not None:
            data.div_(divide_by)
        if stamp is not None:
            send[:, data_bytes:].copy_(stamp.as_bytes().expand(world_size, -1))
        received = pool.take(world_size * frame, torch.uint8, send.device).view(world_size, frame)
        work = dist.all_to_all_single(received.view(-1), send.view(-1), group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            wait_work(work, self.group, stamp)
            if stamp is not None:
                stamp.verify_bytes(received[:, data_bytes:], self.group)
            out = None if result_dtype == dtype else torch.empty(columns, dtype=result_dtype, device=send.device)
            result = packing.sum_rows(list(received[:, :data_bytes].view(dtype).unbind(0)), out)
            pool.give(send)
            pool.give(received)
            return result

        return Pending(finish)

    # [Note: reductions between hosts point to point] A reduce-scatter between hosts is messages too, tagged and stamped
    # as in [Note: gathers point to point]: each rank sends its peer r the r-th row of every gradient, straight from the
    # gradient (a zero-padded copy where the row is short), and receives every peer's row of its own into one buffer;
    # its own row is then added from the gradient itself, as shared memory does (see
    # [Note: the own row stays in the gradient] in ``packing.py``). No send buffer of W rows is packed; under a wire
    # narrower than the gradient, or a division before the sum, every row is packed once, cast and divided in that copy,
    # and the own row is summed from it, rounded as the others are, so that the gradients can go at once. On one host
    # gloo keeps its framed all-to-all in bounded chunks: there the chunks' memory bound matters more than a copy (see
    # [Note: chunks over gloo]); between hosts the buffers are the collective's size anyway (see
    # [Note: chunks between hosts]).
    def _reduce_scatter_point_to_point(
        self,
        grads: list[RankRows],
        dtype: torch.dtype,
        stamp: Stamp | None,
        divide_by: int | None,
        result_dtype: torch.dtype,
    ) -> Pending[torch.Tensor]:
        """See [Note: reductions between hosts point to point] and [Note: an embedding's rows in a reduce-scatter]."""
        world_size, rank, device = self.world_size, self.rank, grads[0].flat.device
        columns = sum(grad.columns for grad in grads)
        peers = [peer for peer in range(world_size) if peer != rank]
        widths = [grad.columns for grad in grads]
        packed = None
        if divide_by is not None or any(grad.flat.dtype != dtype for grad in grads):  # the copy casts and divides
            packed = self.pool.take(world_size * columns, dtype, device).view(world_size, columns)
            packing.pack_rows(grads, packed)
            if divide_by is not None:
                packed.div_(divide_by)
            rows_for = {peer: list(packed[peer].split(widths)) for peer in peers}
        else:
            rows_for = {peer: [_whole_row(grad, peer) for grad in grads] for peer in peers}
        arrived = self.pool.take(len(peers) * columns, dtype, device).view(len(peers), columns)
        arrived_rows = {peer: list(row.split(widths)) for peer, row in zip(peers, arrived, strict=True)}
        by_rows = [index for index, grad in enumerate(grads) if grad.row_numel]
        sparse = [
            SparseRows(
                grads[index].columns // grads[index].row_numel,
                grads[index].row_numel,
                {peer: rows_for[peer][index] for peer in peers},
                {peer: arrived_rows[peer][index] for peer in peers},
            )
            for index in by_rows
        ]
        marks = torch.cat([grads[index].touched_rows(world_size) for index in by_rows]) if by_rows else None
        dense = [index for index in range(len(grads)) if index not in by_rows]
        messages = self._exchange(
            {peer: [rows_for[peer][index] for index in dense] for peer in peers},
            {peer: [arrived_rows[peer][index] for index in dense] for peer in peers},
            stamp,
            beside=marks,
        )
        announce(
            "reduce_scatter", "gloo::point_to_point_reduce_scatter", payload((world_size, columns), dtype), world_size
        )
        # The gradients stay referenced until the sum only where their own row is read from them (no copy made), and a
        # row-sparse one's rows for the peers until its touched rows are sent.
        kept = grads if packed is None else None
        del rows_for

        def finish() -> torch.Tensor:
            every_ranks_marks = messages()
            if every_ranks_marks is not None:
                self._exchange_touched_rows(sparse, every_ranks_marks.amax(dim=0), dtype, stamp)
            result = torch.empty(columns, dtype=result_dtype, device=device)
            if kept is not None:
                packing.sum_own_row(kept, rank, list(arrived.unbind(0)), 1.0, result)
            else:  # every addend rounded to the wire's dtype alike, the own row too, and summed in the result's
                packing.sum_rows([packed[rank], *arrived.unbind(0)], result)
                self.pool.give(packed)
            self.pool.give(arrived)
            return result

        return Pending(finish)

    # [Note: an embedding's rows in a reduce-scatter] An untied embedding's gradient is zero in every row no token of
    # the step looked up (see [Note: an embedding's rows between hosts] in ``sparse_rows.py``, HYBRID's side of it), and
    # in FULL_SHARD between hosts it is the last reduction of backward, which nothing hides. So such a gradient
    # (``RankRows.row_numel``) goes in two exchanges: its one byte a row of marks (non-zero rows) rides in the stamps'
    # gather of the first, beside the other gradients' messages; once that is over every rank knows the union of the
    # rows touched anywhere, and the second exchange sends each peer only the union's rows of its row, straight into the
    # peer's arrived buffer, whose other rows are zero on every rank. The sum is then the same as the dense one, to the
    # bit, and only the rows a step touched cross the link.
    def _exchange_touched_rows(
        self, sparse: list[SparseRows], union: torch.Tensor, dtype: torch.dtype, stamp: Stamp | None
    ) -> None:
        """The second exchange of a reduce-scatter between hosts: of each row-sparse gradient, the rows of each peer's
        row that some rank touched (``union``: one byte a row, every rank's marks combined), received into this rank's
        arrived rows, whose other rows are zero on every rank (see [Note: an embedding's rows in a reduce-scatter]);
        ``dtype``: the wire's."""
        sends: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        lands: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for part, touched in zip(sparse, union.split([self.world_size * part.rows for part in sparse]), strict=True):
            by_owner = touched.view(self.world_size, -1)
            mine = _marked(by_owner[self.rank])
            for peer, source in part.to_peers.items():
                sends.setdefault(peer, []).append((source.view(-1, part.row_numel), _marked(by_owner[peer])))
                lands.setdefault(peer, []).append((part.from_peers[peer].view(-1, part.row_numel).zero_(), mine))
        self._exchange_rows(sends, lands, dtype, stamp)

    # [Note: chunks over gloo] A reduce-scatter on one host whose buffers would exceed ``chunk_limit()`` (a language
    # model's root: its embedding and head) runs as a series of collectives of at most that many bytes each, every chunk
    # a frame with its stamp, summed straight into the result. (A unit's gather needs no buffer of its own at all: see
    # [Note: gathers point to point].) At most ``PIPELINE`` chunks are in flight, the next one packed while gloo's
    # threads move the one before, and their buffers come back to the pool for the next chunk, so a collective's
    # temporaries are a few chunks whatever the unit's size, rather than whole-unit buffers held by the pool until the
    # end of the step. The chunks left in flight when the collective is issued finish in its ``wait``, behind compute.
    def _reduce_scatter_chunked(
        self,
        grads: list[RankRows],
        columns: int,
        per_chunk: int,
        dtype: torch.dtype,
        stamp: Stamp | None,
        divide_by: int | None,
        result_dtype: torch.dtype,
    ) -> Pending[torch.Tensor]:
        world_size, device = self.world_size, grads[0].flat.device
        full_frame = frame_bytes(per_chunk * dtype.itemsize, stamp)
        result = torch.empty(columns, dtype=result_dtype, device=device)

        def launch(start: int, stop: int) -> tuple[Any, ...]:
            data_bytes = (stop - start) * dtype.itemsize
            frame = frame_bytes(data_bytes, stamp)
            send = self.pool.take(world_size * full_frame, torch.uint8, device)
            received = self.pool.take(world_size * full_frame, torch.uint8, device)
            frames = send[: world_size * frame].view(world_size, frame)
            data = frames[:, :data_bytes].view(dtype)
            packing.pack_rows(grads, data, start)
            if divide_by is not None:
                data.div_(divide_by)
            if stamp is not None:
                frames[:, data_bytes:].copy_(stamp.as_bytes().expand(world_size, -1))
            work = dist.all_to_all_single(
                received[: world_size * frame], send[: world_size * frame], group=self.group, async_op=True
            )
            return work, send, received, start, stop, data_bytes, frame

        def land(chunk: tuple[Any, ...]) -> None:
            work, send, received, start, stop, data_bytes, frame = chunk
            wait_work(work, self.group, stamp)
            frames = received[: world_size * frame].view(world_size, frame)
            if stamp is not None:
                stamp.verify_bytes(frames[:, data_bytes:], self.group)
            packing.sum_rows(list(frames[:, :data_bytes].view(dtype).unbind(0)), result[start:stop])
            self.pool.give(send, keep=True)
            self.pool.give(received, keep=True)

        rest = _pipelined(columns, per_chunk, launch, land, self.chunks_in_flight)  # ``grads`` can go now

        def finish() -> torch.Tensor:
            rest()
            return result

        return Pending(finish)

    # [Note: chunks between hosts] Across a link, the bound of [Note: chunks over gloo] costs what it saves: the issuing
    # rank waits for the link to land a chunk before it may launch the next one, and a gloo pair with one message in
    # flight at a time moves far less than the link's rate (``benchmarks/history.md``). So a transport between hosts
    # (``between_hosts``) launches every chunk of an all-reduce, and every message of a gather or reduce-scatter, when
    # it is issued, each on gloo's threads: the training thread never waits on the link at issue, and the link always
    # has a queue. Its buffers are the collective's size, as they would be whole.
    def all_reduce(
        self, grads: list[torch.Tensor], dtype: torch.dtype, stamp: Stamp | None, divide_by: int | None = None
    ) -> Pending[torch.Tensor]:
        numel = sum(grad.numel() for grad in grads)
        flat = torch.empty(numel + (DIGEST_BITS if stamp is not None else 0), dtype=dtype, device=grads[0].device)
        packing.pack(grads, flat[:numel])
        if divide_by is not None:
            flat[:numel].div_(divide_by)
        if stamp is not None:
            flat[numel:].copy_(stamp.digest(dtype))
        # Between hosts, in chunks all in flight at once (see [Note: chunks between hosts]); the digest rides on the
        # last one. On one host, one message.
        per_chunk = _per_chunk(self.world_size, dtype, None) if self.crosses_hosts else 0
        bounds = list(range(0, numel, per_chunk))[1:] if per_chunk else []
        pieces = [flat[start:stop] for start, stop in zip([0, *bounds], [*bounds, flat.numel()], strict=True)]
        works = [dist.all_reduce(piece, group=self.group, async_op=True) for piece in pieces]

        def finish() -> torch.Tensor:
            for work in works:
                wait_work(work, self.group, stamp)
            if stamp is not None:
                stamp.verify_digest(flat[numel:], self.world_size)
            return flat[:numel]

        return Pending(finish)


def _per_chunk(world_size: int, dtype: torch.dtype, stamp: Stamp | None) -> int:
    """Elements (a gather) or columns (a reduce-scatter) per chunk: world_size frames within ``chunk_limit()``."""
    return max(chunk_limit() // world_size - frame_bytes(0, stamp), 0) // dtype.itemsize


def _pipelined(
    total: int,
    per_chunk: int,
    launch: Callable[[int, int], Any],
    land: Callable[[Any], None],
    most: int | None,
) -> Callable[[], None]:
    """``launch(start, stop)`` the chunks of ``total`` units, at most ``most`` in flight (the oldest landed before
    the next is launched; None: all at once); returns what lands those still in flight."""
    in_flight: deque[Any] = deque()
    for start in range(0, total, per_chunk):
        if len(in_flight) == most:
            land(in_flight.popleft())
        in_flight.append(launch(start, min(start + per_chunk, total)))

    def rest() -> None:
        while in_flight:
            land(in_flight.popleft())

    return rest


def _marked(marks: torch.Tensor) -> torch.Tensor:
    """The indices of the non-zero bytes of ``marks`` (one a row)."""
    return marks.nonzero().squeeze(1)


def _pieces(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The messages ``tensors`` travel in: pieces of at most ``chunk_limit()`` bytes, none empty."""
    return [
        piece
        for tensor in tensors
        if tensor.numel()
        for piece in tensor.view(-1).split(max(chunk_limit() // tensor.element_size(), 1))
    ]


def _whole_row(grad: RankRows, row: int) -> torch.Tensor:
    """Row ``row`` of the gradient's zero-padded (world_size, columns) view: a view of the gradient where it is whole,
    else a zero-padded copy (the last rows of an uneven parameter, or a gradient that never arrived)."""
    part = packing.row_of(grad, row)
    if part.numel() == grad.columns:
        return part
    whole = torch.zeros(grad.columns, dtype=grad.flat.dtype, device=grad.flat.device)
    whole[: part.numel()].copy_(part)
    return whole
