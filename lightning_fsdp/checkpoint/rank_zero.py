"""A full checkpoint is one file that rank 0 writes for every rank: the protocol both strategies save it by.

Rank 0 checks the destination (a local path or a URL) and every rank raises its refusal, before anything is gathered
or written; then rank 0 writes, the other ranks taking part in what it gathers, and every rank learns how the write
went and raises alike, instead of waiting for rank 0 in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fsdp.checkpoint.atomic import Ranks, check_destination, raise_on_every_rank, refusal_error
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote import remote_refusal


def refuse_full_destination(
    final: str | Path, expected_bytes: int = 0, storage_options: dict[str, Any] | None = None
) -> None:
    """Every rank raises rank 0's refusal to write a full checkpoint at ``final`` (a collective)."""
    ranks = Ranks.of(collective=True)
    refusal = None
    if ranks.rank == 0:
        if is_remote(final):
            refusal = remote_refusal(str(final), "full", storage_options)
        else:
            refusal = check_destination(Path(final), "full", expected_bytes)
    refusal = ranks.broadcast(refusal)
    if refusal is not None:
        raise refusal_error(refusal)


def save_on_rank_zero(final: str | Path, save: Callable[[], None]) -> None:
    """Call ``save`` on every rank (rank 0 writes ``final``; the others take part in its gathers, if any), then raise
    on every rank if rank 0's write failed (a collective). A rank's own failure is raised on that rank."""
    failure = None
    try:
        save()
    except BaseException as err:
        failure = err
    rank_zero = Ranks.of(collective=True).rank == 0
    raise_on_every_rank(failure if rank_zero else None, str(final) if is_remote(final) else Path(final))
    if failure is not None:
        raise failure
