"""Checkpoints written in the background while training goes on: one save in flight at most, no failure lost.

A save is split where training must wait and where it need not. At the call (a step boundary, every rank together)
the previous write is waited for, every rank checks its destination, and this rank's part of the checkpoint is copied
into a snapshot that later steps cannot change. Then a thread writes the snapshot through the same atomic
``save_sharded`` a synchronous save uses: the checkpoint appears under its name only when complete, and a process
killed during the write leaves the previous checkpoint there intact. The write's collectives run on a process group of
their own (see [Note: the background save's own process group]); a write that fails is raised by the next call, on
every rank alike.
"""

from __future__ import annotations

import errno
import io
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from lightning_fsdp.checkpoint.atomic import refuse_on_every_rank, tensor_bytes
from lightning_fsdp.checkpoint.sharded import save_sharded

__all__ = ["BackgroundSaver"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Outcome:
    """How one rank's background write went, in a form every rank can read."""

    rank: int
    errno: int | None
    error: str


class BackgroundSaver:
    """Saves of one process, each written by a background thread; at most one in flight.

    A write that fails is agreed on by every rank's writer (one more collective on the saves' group) and kept; the
    next save, ``remove_later``'s caller or ``close`` raises it, the same sentence on every rank. Removals asked for
    while a write is in flight (``ModelCheckpoint`` dropping the checkpoint the new one replaces) run after it, and
    only if it succeeded: a failed write leaves the older checkpoint in place, the newest complete one.

    Args:
        timeout: how long a collective of the background write may wait (the strategy's timeout).
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._timeout = timeout
        self._group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._removals: list[Callable[[], None]] = []
        self._writing = False  # until the writer has run the removals queued for it (under the lock)
        self._lock = threading.Lock()

    def save(self, path: str | Path, state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Snapshot ``state`` (sharded, see ``sharded_checkpoint_state``) and ``meta`` and write them in the
        background to this rank's ``path`` (a collective: every rank calls it, each with its own path).

        At the call: the previous background write is waited for, and its failure, if it had one, is raised here;
        every rank checks its destination (a refusal is raised at once, as a synchronous save raises it); this rank's
        shards and optimizer state are copied to CPU memory (torch's ``BlockingAsyncStager``), and the rest of the
        checkpoint is serialised as ``meta.pt``'s bytes. This copy is what blocks training, and the only memory a save
        costs: one copy of this rank's part, freed when it is written. A process killed during the write leaves its
        temporary behind, removed by the next save into the folder (see ``temporaries.py``).
        """
        path = Path(path)
        self.wait()
        group = self._checkpoint_group()
        refuse_on_every_rank(path, "sharded", tensor_bytes(state), group)
        staged = BlockingAsyncStager().stage(state)
        buffer = io.BytesIO()
        torch.save(meta, buffer)
        meta_bytes = buffer.getvalue()
        self._start(path, lambda: save_sharded(path, staged, meta_bytes, group=group), group)

    def write(self, path: str | Path, write: Callable[[], None]) -> None:
        """Run ``write`` in the background: this rank's part of a save whose destination checks and snapshot the
        caller has made (rank 0's full file; ``lambda: None`` on the others). A collective, as ``save`` is: every
        rank's writer agrees on the outcome, so a failure on rank 0 is raised on every rank."""
        self.wait()
        self._start(path, write, self._checkpoint_group())

    def remove_later(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` after the write in flight has succeeded (dropped if it fails), or now when none is."""
        with self._lock:
            if self._writing:
                self._removals.append(remove)
                return
        self._raise_failure()
        remove()

    def wait(self) -> None:
        """Wait for the write in flight, then raise its failure (once) if it had one."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def close(self) -> BaseException | None:
        """Wait for the last write (teardown); return its failure instead of raising it. The saves' own process group
        is destroyed (a later save makes a new one)."""
        try:
            self.wait()
        except BaseException as err:
            return err
        finally:
            self._destroy_group()
        return None

    def _destroy_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    # [Note: the background save's own process group] Every collective of the write (the agreements of
    # ``atomic_directory``, DCP's plan and metadata exchange) runs on a gloo group created once for checkpointing, never
    # on the training group: collectives of one group issued from two threads at once would interleave in a different
    # order on different ranks. The group spans every rank, and each rank's writer thread progresses on its own, so a
    # rank whose main thread waits for its write never waits on another rank's training.
    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group of every background collective, created once (a collective on the default group); None
        outside a process group. See [Note: the background save's own process group]."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def _start(self, path: str | Path, write: Callable[[], None], group: dist.ProcessGroup | None) -> None:
        self._writing = True
        self._thread = threading.Thread(
            target=self._write, args=(path, write, group), name="lightning_fsdp-save", daemon=False
        )
        self._thread.start()

    def _write(self, path: str | Path, write: Callable[[], None], group: dist.ProcessGroup | None) -> None:
        failure: BaseException | None = None
        try:
            write()
        except BaseException as err:
            failure = err
        try:
            agreed = _agreed_failure(failure, path, group)
        except BaseException as err:  # the agreement itself failed (a peer died): this rank's own error, kept
            agreed = err
        with self._lock:
            removals, self._removals = self._removals, []
            if agreed is None:
                for remove in removals:
                    try:
                        remove()
                    except OSError as err:
                        agreed = err
                        break
            self._failure = agreed
            self._writing = False
        if agreed is not None:  # said at once as well: a process that ends without a teardown still tells
            log.error("%s", agreed)


def _agreed_failure(
    failure: BaseException | None, path: str | Path, group: dist.ProcessGroup | None
) -> BaseException | None:
    """The write's failure as every rank's writer will raise it (a collective on ``group``): the lowest failing rank's
    error in one sentence, an ``OSError`` with its errno where it had one (a full disk), else a ``RuntimeError``."""
    mine = None if failure is None else _outcome(failure, dist.get_rank(group) if group is not None else 0)
    outcomes = [mine]
    if group is not None:
        outcomes = [None] * dist.get_world_size(group)
        dist.all_gather_object(outcomes, mine, group=group)
    failed = [outcome for outcome in outcomes if outcome is not None]
    if not failed:
        return None
    first = min(failed, key=lambda outcome: outcome.rank)
    sentence = (
        f"the background save to {path} failed on rank {first.rank} ({first.error}); that checkpoint was not saved "
        "and the one its name held before is intact: fix the cause and save again."
    )
    agreed: BaseException = OSError(first.errno, sentence) if first.errno else RuntimeError(sentence)
    agreed.__cause__ = failure
    return agreed


def _outcome(failure: BaseException, rank: int) -> _Outcome:
    """``failure`` as the rank it happened on and one line: DCP's ``CheckpointException`` (raised on every rank when
    one fails) stands for the lowest rank in it that failed, and that rank's own error."""
    if isinstance(failure, CheckpointException) and failure.failures:
        rank = min(failure.failures)
        failure = failure.failures[rank][0]
    if isinstance(failure, OSError) and failure.errno == errno.ENOSPC and failure.strerror:
        return _Outcome(rank, failure.errno, failure.strerror)
    return _Outcome(rank, getattr(failure, "errno", None), f"{type(failure).__name__}: {failure}")
