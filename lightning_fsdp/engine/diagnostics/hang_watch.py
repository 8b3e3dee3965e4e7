"""Where each rank waits, so that no wait outlasts the reason for it.

A rank waiting for a peer that entered another collective, or left the loop, would otherwise wait until the process
group's timeout. So a wait that has lasted ``POST_AFTER_S`` posts where it is on the process group's store and reads
where its peers are, and raises ``PeerElsewhereError`` where neither can ever finish: ``Waiting`` for the engine's own
waits (``wait_work`` on gloo, the shared-memory transport's), ``MainThreadWatch`` for collectives called straight
through ``torch.distributed``. The same waits raise what a signal handler set with ``interrupt_waits``.
See [Note: every wait knows where its peers are], above ``Waiting``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.transport.identity import CollectiveMismatchError, Stamp

POST_AFTER_S = 1.0
CHECK_EVERY_S = 0.5
POLL_S = 0.2
_PREFIX = "lightning_fsdp/hang_watch/"
_POLL_EXPIRED = "Operation timed out!"  # c10d's Work.wait(timeout) when the timeout passes, the work still in flight


class PeerElsewhereError(CollectiveMismatchError):
    """A rank this rank waits on waits in another collective that needs this rank: neither can ever finish."""


class PeerStoppedError(RuntimeError):
    """A collective failed because a peer raised (``PeerElsewhereError``) and left."""


class _State:
    phase: str | None = None  # what the loop is doing, set by the strategy at every step
    interrupt: BaseException | None = None  # raised by the next wait that checks (a signal arrived)
    interrupt_after_s: float = 0.0  # ... once that wait has lasted this long


STATE = _State()


def set_phase(phase: str | None) -> None:
    """What this rank's loop is doing now (see [Note: every wait knows where its peers are]); None: anything."""
    STATE.phase = phase


def interrupt_waits(error: BaseException | None, after_waiting_s: float = 0.0) -> None:
    """Make every long wait of this process raise ``error`` within ``POLL_S`` of having lasted ``after_waiting_s`` (a
    signal handler's way out); None takes it back.

    A signal handler cannot raise into a wait that blocks in C++ or on a peer that never comes, so SIGTERM's handler
    sets the exception and every long wait (past its first ``POLL_S`` on gloo, ``LIVENESS_EVERY_S`` on shared memory)
    raises it. Outside ``fit`` any long wait does (``trainer/evaluation_signals.py``); during ``fit`` only one that has
    lasted ``STUCK_WAIT_S``, so that a signal that arrives in a healthy step is still acted on at the batch end, by
    every rank together (see [Note: SIGTERM in a wait that does not end] in ``trainer/preemption.py``)."""
    STATE.interrupt, STATE.interrupt_after_s = error, after_waiting_s


def raise_if_interrupted(waited_s: float) -> None:
    error = STATE.interrupt
    if error is not None and waited_s >= STATE.interrupt_after_s:
        STATE.interrupt = None
        raise error


def place_of(stamp: Stamp | None, otherwise: str) -> str:
    """The collective a stamp names, as every rank in it names it."""
    return f"the {stamp.ledger.describe(stamp.values())}" if stamp is not None else otherwise


def _store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


# [Note: every wait knows where its peers are] A collective ends when every rank of its group has entered it. A rank
# that entered another one instead (Lightning's epoch-end ``sync_dist`` while its peer still gathers for a batch the
# first rank does not have), or that left the loop, never will, and both would wait until the process group's timeout:
# the stamps are no help, since they only travel with the data of the engine's own collectives. Ranks cannot read each
# other's stacks, so each says where it is, on the process group's own store (the c10d ``TCPStore`` every rank already
# talks to), but only once a wait has lasted ``POST_AFTER_S``: a step's hundreds of short waits cost nothing, and a rank
# is only ever asked about when it is stuck. A rank that has waited that long posts its place (the collective, its
# group's ranks, what the rank was doing: ``phase``) and from then on reads its peers' posts every ``CHECK_EVERY_S``. It
# raises ``PeerElsewhereError`` when a peer it waits on is waiting in another collective whose group holds this rank too
# -- neither can ever finish: each needs the other -- naming both places. Both see it, so both raise within about
# ``POST_AFTER_S + CHECK_EVERY_S``. A peer that waits in a collective of a group without this rank is left alone: it may
# be waiting on a third rank that is merely slow.
#
# ``phase`` says what the loop was doing ("training batch 3 of epoch 0"). Two ranks in the same collective of different
# phases (one started the next epoch while the other is still in the last batch of this one: data that ends at different
# points) are elsewhere too; a rank that serves its peers' evaluation gathers (``phase`` None) matches any.
#
# Collectives called straight through ``torch.distributed`` block in C++, where no check of ours runs: there
# ``MainThreadWatch`` posts for the rank. Waits on gloo go through ``wait_work``, which wakes every ``POLL_S`` to run
# the checks. Every long wait also raises what ``interrupt_waits`` set (SIGTERM's way out of a wait).
class Waiting:
    """One wait that has gone on for a while: it posts where it is and reads where its peers are."""

    def __init__(self, place: str, group: ProcessGroup | None, peers: Sequence[int] | None = None) -> None:
        self.place, self.group = place, group
        self._peers = peers  # global ranks; None: every other rank of ``group``
        self.store = _store()
        self.posted = False
        self.started = time.monotonic()
        self.next_check = self.started + POST_AFTER_S

    def tick(self) -> None:
        """Called between reads by a long wait: raises a pending interrupt when due, where the peers wait too."""
        now = time.monotonic()
        raise_if_interrupted(now - self.started)
        if self.store is None or now < self.next_check:
            return
        self.next_check = now + CHECK_EVERY_S
        try:
            if not self.posted:
                self._post()
            entries = self._peer_entries()
        except (RuntimeError, dist.DistError):
            return  # the store went with the rank that held it: that rank's exit fails this wait
        self._check(entries)

    def done(self) -> None:
        if self.posted and self.store is not None:
            self.posted = False
            _quietly(self.store.set, _PREFIX + str(dist.get_rank()), "")

    def _ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)

    def _post(self) -> None:
        entry = {"place": self.place, "ranks": self._ranks(), "phase": STATE.phase}
        self.store.set(_PREFIX + str(dist.get_rank()), json.dumps(entry))
        self.posted = True

    def _peer_entries(self) -> dict[int, bytes]:
        """What every peer this waits on has posted (a peer that never posted is not stuck)."""
        me = dist.get_rank()
        peers = self._peers if self._peers is not None else [r for r in self._ranks() if r != me]
        keys = {rank: _PREFIX + str(rank) for rank in peers}
        posted = [rank for rank, key in keys.items() if self.store.check([key])]
        return dict(zip(posted, self.store.multi_get([keys[r] for r in posted]), strict=True)) if posted else {}

    def _check(self, entries: dict[int, bytes]) -> None:
        me = dist.get_rank()
        for rank, raw in entries.items():
            if not raw:
                continue
            entry = json.loads(raw)
            if me not in entry["ranks"]:
                continue  # it waits on others; it may go on once they come
            same_phase = entry["phase"] is None or STATE.phase is None or entry["phase"] == STATE.phase
            if entry["place"] != self.place or not same_phase:
                # The peer checks as often: give it the time to see this rank's post and raise the same error itself,
                # rather than the bare one of a collective broken by this rank's exit.
                time.sleep(CHECK_EVERY_S * 1.5)
                self.done()
                mine, theirs = f"{self.place}{_during(STATE.phase)}", f"{entry['place']}{_during(entry['phase'])}"
                raise _posted(
                    PeerElsewhereError(
                        f"rank {me} waits for rank {rank} in {mine}, but rank {rank} waits in {theirs}: neither can "
                        "finish. Ranks must run the same collectives in the same order; where their data ends at "
                        "different points give every rank the same number of batches (Lightning's distributed "
                        "sampler, drop_last, or equal per-rank shards)."
                    )
                )


def _posted(error: Exception) -> Exception:
    """``error``, left on the store too: a peer freed from a wait by this rank's exit says why (``failure_of``)."""
    store = _store()
    if store is not None:
        _quietly(store.set, _PREFIX + "failed/" + str(dist.get_rank()), str(error))
    return error


def _quietly(write: Callable[..., Any], *args: Any) -> None:
    """A write to the store that may find it gone (the rank that held it has exited): nothing left to tell."""
    with contextlib.suppress(RuntimeError, dist.DistError):
        write(*args)


def failure_of(group: ProcessGroup | None, group_rank: int) -> str | None:
    """What rank ``group_rank`` of ``group`` raised before it exited, if it was one of these checks."""
    store = _store()
    if store is None:
        return None
    key = _PREFIX + "failed/" + str(dist.get_global_rank(group or dist.group.WORLD, group_rank))
    try:
        return store.get(key).decode() if store.check([key]) else None
    except (RuntimeError, dist.DistError):  # the store went with the rank that held it
        return None


def _explained(error: RuntimeError, group: ProcessGroup | None, place: str) -> RuntimeError:
    """A collective that failed because a peer raised one of these checks and left: say what it raised."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    group = group if group is not None else dist.group.WORLD
    for rank in dist.get_process_group_ranks(group):
        said = failure_of(group, dist.get_group_rank(group, rank)) if rank != dist.get_rank() else None
        if said:
            return PeerStoppedError(
                f"rank {rank} stopped while this rank waited for it in {place}; this rank stops too. It raised: {said}"
            )
    return error


def _during(phase: str | None) -> str:
    return f" (during {phase})" if phase else ""


def wait_work(work: dist.Work, group: ProcessGroup | None, stamp: Stamp | None = None, what: str = "") -> None:
    """``work.wait()``, but one that knows where its peers are and can be interrupted
    (see [Note: every wait knows where its peers are]). The place it posts: the stamp's collective, else ``what``. It
    wakes every ``POLL_S`` to run the checks (``Work.wait`` with a timeout leaves the work in flight)."""
    if work.is_completed():
        work.wait()
        return
    waiting: Waiting | None = None
    poll = datetime.timedelta(seconds=POLL_S)
    try:
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError as error:
                if _POLL_EXPIRED not in str(error):  # the work's own failure (a peer gone, the group's timeout)
                    raise _explained(error, group, place_of(stamp, what or "a gloo collective")) from error
            if waiting is None:
                waiting = Waiting(place_of(stamp, what or "a gloo collective"), group)
            waiting.tick()
    finally:
        if waiting is not None:
            waiting.done()


_C10D = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")


def _blocking_call(frame: FrameType | None) -> str | None:
    """The ``torch.distributed`` call the stack is in, and its first caller outside torch.distributed."""
    call = None
    while frame is not None:
        filename = frame.f_code.co_filename.replace("\\", "/")
        if filename.endswith(_C10D[0]):
            call = frame.f_code.co_name
        elif call is not None and not filename.endswith(_C10D):
            where = "/".join(filename.split("/")[-3:])
            return f"torch.distributed.{call} called from {where}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return call and f"torch.distributed.{call}"


class MainThreadWatch(threading.Thread):
    """The thread that posts where the main thread blocks in ``torch.distributed``
    (see [Note: every wait knows where its peers are]), for one run: it runs from ``watch_main_thread`` until ``stop``
    (the run's teardown) or until its owner is garbage-collected.

    Collectives called straight through ``torch.distributed`` (Lightning's loops broadcast at every training batch; user
    code) block in C++ where no check of ours runs, so this thread looks at the main thread's stack every
    ``CHECK_EVERY_S``: once it has stayed ``POST_AFTER_S`` inside one ``torch.distributed`` call, it posts that call and
    its caller as the rank's place (over every rank: the group is not known). Its peers' checks then name it; the rank
    itself is freed when they raise and its collective fails. The strategy starts it with the process group and stops it
    (joined) at its teardown, so none is left after ``fit``."""

    def __init__(self, owner: object) -> None:
        super().__init__(name="lightning_fsdp-hang-watch", daemon=True)
        self.main = threading.main_thread().ident
        self._stopping = threading.Event()
        self._owner_gone = weakref.finalize(owner, self.stop)

    def stop(self) -> None:
        """End the thread and wait for it; its post, if it made one, is taken back. Safe to call twice."""
        self._owner_gone.detach()
        self._stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def run(self) -> None:
        seen, since, posted = None, 0.0, False
        while not self._stopping.wait(CHECK_EVERY_S):
            try:
                seen, since, posted = self._look(seen, since, posted)
            except (RuntimeError, ValueError):  # the group went away under it (the end of the run): look again later
                seen, posted = None, False
        store = _store()
        if posted and store is not None:
            _quietly(store.set, _PREFIX + str(dist.get_rank()), "")

    def _look(self, seen: str | None, since: float, posted: bool) -> tuple[str | None, float, bool]:
        store = _store()
        if store is None:
            return None, 0.0, False
        call = _blocking_call(sys._current_frames().get(self.main))
        now = time.monotonic()
        if call != seen:
            if posted:
                store.set(_PREFIX + str(dist.get_rank()), "")
            return call, now, False
        if call is not None and not posted and now - since >= POST_AFTER_S:
            entry = {"place": call, "ranks": list(range(dist.get_world_size())), "phase": STATE.phase}
            store.set(_PREFIX + str(dist.get_rank()), json.dumps(entry))
            return call, since, True
        return seen, since, posted


def watch_main_thread(owner: object) -> MainThreadWatch:
    """Start the thread that posts where the main thread blocks in ``torch.distributed``, for the run of ``owner``
    (a strategy): ``owner`` stops it at its teardown, or it stops when ``owner`` is garbage-collected."""
    watch = MainThreadWatch(owner)
    watch.start()
    return watch
