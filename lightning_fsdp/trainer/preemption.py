"""Signals that arrive inside a training step, acted on at a batch boundary by every rank together.

[Note: deferred signals] A Python signal handler runs wherever the main thread is, which during ``fit`` is nearly
always inside ``training_step``: units gathered, this rank part-way through collectives its peers are waiting in.
Lightning's handlers then do collective work on the spot. The SLURM requeue handler (``SLURMEnvironment(
auto_requeue=True)``, SIGUSR1 by default) calls ``trainer.save_checkpoint``, which the engine refuses while units are
busy ("full_state_dict was called during forward or backward"): no HPC checkpoint, no requeue, the job dies. The
SIGTERM handler broadcasts from rank 0 while rank 0 waits for this rank inside a unit's collective: both wait until
the process group's timeout (30 minutes by default).

So for the length of ``fit`` (``FSDPStrategy.on_train_start`` installs it, ``on_train_end`` and the strategy's
teardown remove it) the handlers Lightning installed for those two signals only record that the signal came. At the
end of the training batches, where the units are idle and every rank passes, the ranks agree on what any of them
received -- an all-reduce (MAX) of ``world_size + 1`` small integers, so ranks signalled at different moments agree
too -- and then, all at the same step boundary:

- the requeue signal: every rank runs Lightning's own handler (the HPC checkpoint, written collectively; then rank 0
  runs ``scontrol requeue``), and training goes on until the scheduler stops the job;
- SIGTERM: the ranks that received it leave with Lightning's ``SIGTERMException`` (exit status 143, a process ended
  by SIGTERM), the others raise :class:`PeerTerminatedError` naming them. Callbacks' ``on_exception`` runs on every
  rank at the same point, so a save there (Lightning's ``OnExceptionCheckpoint``) is collective too.

[Note: agreement a batch late] A blocking all-reduce at every batch end costs the step one round trip through the
collective's backend: on a loaded CPU host a gloo round trip takes milliseconds (measured: 3.7 ms median, 16 ms p90 on
2 ranks over 2 busy cores), the wait for the slower rank aside. So the flags of batch ``k`` are all-reduced in the
background (``async_op=True``) while batch ``k + 1`` trains, and read at its end: the step pays only for issuing the
collective, and every rank acts at the end of batch ``k + 1`` on the same result. A signal is therefore acted on at
the end of the batch after the one it arrived in (``benchmarks/bench_signals.py`` measures what remains).

What this gives up: a signal still unread when training ends is acted on at ``on_train_end`` (the requeue, with one
blocking all-reduce) or not at all (SIGTERM: training is done); Lightning's SIGTERM handler itself is not run (its
in-handler broadcast is the hang), so neither is a SIGTERM handler installed before the Trainer's, which Lightning
chains into it. Outside ``fit`` (``validate``, ``test``, ``predict``) Lightning's handlers run as they are.
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

log = logging.getLogger(__name__)

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
Handler = Callable[[int, FrameType | None], Any]


class PeerTerminatedError(RuntimeError):
    """Another rank received SIGTERM; this rank stops at the same step boundary."""


class DeferredSignals(Callback):
    """Records the requeue signal and SIGTERM during ``fit`` and acts on them at batch ends, on every rank together.

    See [Note: deferred signals]. Added to ``trainer.callbacks`` by :meth:`install`, taken out by :meth:`remove`.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._requeue_signal = _requeue_signal(trainer)
        self._handlers: dict[int, Handler] = {}  # Lightning's handlers, run when every rank agrees
        self._received: set[int] = set()
        self._in_flight: tuple[dist.Work, torch.Tensor] | None = None  # the last batch's flags, being all-reduced

    @classmethod
    def install(cls, trainer: pl.Trainer) -> DeferredSignals | None:
        """Take over the handlers of the two signals for this fit: Lightning's, or for the requeue signal one set
        before the Trainer's (which Lightning leaves in place). None where signals cannot be handled (not the main
        thread, as in Lightning's own registration)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        deferred = cls(trainer)
        for signum in (deferred._requeue_signal, signal.SIGTERM):
            handler = signal.getsignal(signum) if signum is not None else None
            if callable(handler):
                deferred._handlers[signum] = handler
                signal.signal(signum, deferred._record)
        trainer.callbacks.append(deferred)
        return deferred

    def remove(self) -> None:
        """Give the signals back to Lightning's handlers and leave the Trainer's callbacks (safe to call twice)."""
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._handlers.items():
                if signal.getsignal(signum) == self._record:
                    signal.signal(signum, handler)
        self._handlers = {}
        if self in self._trainer.callbacks:
            self._trainer.callbacks.remove(self)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received.add(signum)  # nothing else here: this runs in the middle of whatever the main thread does

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._act(*self._agree(wait_for_all=False), stop_on_sigterm=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._act(*self._agree(wait_for_all=True), stop_on_sigterm=False)  # training is done: nothing left to stop
        self.remove()

    def _act(self, requeue: bool, terminated: list[int], stop_on_sigterm: bool) -> None:
        if requeue:
            assert self._requeue_signal is not None
            log.info("requeue signal: every rank saves the HPC checkpoint after step %d", self._trainer.global_step)
            with self._trainer.strategy.saves_complete_on_return():  # the job may end as soon as the handler returns
                self._handlers[self._requeue_signal](self._requeue_signal, inspect.currentframe())
        if terminated and stop_on_sigterm:
            self._stop(terminated)

    def _agree(self, wait_for_all: bool) -> tuple[bool, list[int]]:
        """(whether any rank received the requeue signal, the ranks that received SIGTERM), the same on every rank.

        See [Note: agreement a batch late]. Slot 0 holds the requeue flag, slot 1 + r rank r's SIGTERM. With
        ``wait_for_all``, this batch's flags count too (the end of training, where no batch follows).
        """
        requeue = self._take(self._requeue_signal)
        terminated = self._take(signal.SIGTERM)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return requeue, [0] if terminated else []
        flags = [0] * (dist.get_world_size() + 1)
        flags[0] = int(requeue)
        flags[1 + dist.get_rank()] = int(terminated)
        local = torch.tensor(flags, dtype=torch.int32, device=self._trainer.strategy.root_device)
        agreed = [0] * len(flags)
        if self._in_flight is not None:
            work, previous = self._in_flight
            self._in_flight = None
            work.wait()
            agreed = previous.tolist()
        if wait_for_all:
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            agreed = [max(pair) for pair in zip(agreed, local.tolist(), strict=True)]
        else:
            self._in_flight = (dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True), local)
        return bool(agreed[0]), [rank for rank, flag in enumerate(agreed[1:]) if flag]

    def _take(self, signum: int | None) -> bool:
        if signum is None or signum not in self._received:
            return False
        self._received.discard(signum)
        return True

    def _stop(self, terminated: list[int]) -> None:
        step = self._trainer.global_step
        if self._rank() in terminated:
            log.warning("rank %d: SIGTERM received; every rank stops after step %d", self._rank(), step)
            raise SIGTERMException(SIGTERM_EXIT_STATUS)
        names = ("rank " if len(terminated) == 1 else "ranks ") + ", ".join(str(rank) for rank in terminated)
        raise PeerTerminatedError(
            f"{names} received SIGTERM (a node being drained, or the job cancelled) and every rank stopped "
            f"after step {step}; resume from the last checkpoint."
        )

    def _rank(self) -> int:
        return self._trainer.global_rank


def _requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal Lightning's SLURM requeue handler listens to, when it installs one."""
    environment = trainer.strategy.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal or signal.SIGUSR1
    return None
