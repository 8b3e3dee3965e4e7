"""Signals that arrive inside a training step, acted on at a batch boundary by every rank together.

During ``fit`` the handlers Lightning installs for the SLURM requeue signal and SIGTERM only record that the signal
came; at the end of each training batch the ranks agree on what any of them received and act on it together, where
the units are idle and a save can be collective (see [Note: deferred signals] above ``DeferredSignals``). The
agreement runs in the background behind the optimizer step (see [Note: agreement behind the optimizer step]), and a
SIGTERM also ends a wait for a peer that never comes (see [Note: SIGTERM in a wait that does not end]).
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_fsdp.engine.diagnostics.hang_watch import interrupt_waits, wait_work

log = logging.getLogger(__name__)

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
STUCK_WAIT_S = 3.0  # a wait this long after a SIGTERM ends the rank: see [Note: SIGTERM in a wait that does not end]
Handler = Callable[[int, FrameType | None], Any]


class PeerTerminatedError(RuntimeError):
    """Another rank received SIGTERM; this rank stops at the same step boundary."""


class Agreement(NamedTuple):
    """One rank's flags in an all-reduce (MAX) over every rank: slot 0 the requeue signal, slot ``1 + r`` rank ``r``'s
    SIGTERM. ``work`` is None where there is no peer (one process), or once the all-reduce is done."""

    work: dist.Work | None
    flags: torch.Tensor

    def wait(self) -> tuple[bool, list[int]]:
        """(whether any rank received the requeue signal, the ranks that received SIGTERM), the same on every rank.
        On CPU the wait knows where its peers are and a SIGTERM ends it (see ``wait_work``)."""
        if self.work is not None and self.flags.device.type == "cpu":
            wait_work(self.work, None, what="the batch-end agreement on signals")
        elif self.work is not None:
            self.work.wait()
        agreed = self.flags.tolist()
        return bool(agreed[0]), [rank for rank, flag in enumerate(agreed[1:]) if flag]


# [Note: deferred signals] A Python signal handler runs wherever the main thread is, which during ``fit`` is nearly
# always inside ``training_step``: units gathered, this rank part-way through collectives its peers are waiting in.
# Lightning's handlers then do collective work on the spot. The SLURM requeue handler
# (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default) calls ``trainer.save_checkpoint``, which the engine
# refuses while units are busy ("full_state_dict was called during forward or backward"): no HPC checkpoint, no requeue,
# the job dies. The SIGTERM handler broadcasts from rank 0 while rank 0 waits for this rank inside a unit's collective:
# both wait until the process group's timeout (30 minutes by default).
#
# So for the length of ``fit`` (``FSDPStrategy.on_train_start`` installs it, ``on_train_end`` and the strategy's
# teardown remove it) the handlers Lightning installed for those two signals only record that the signal came. At the
# end of the training batches, where the units are idle and every rank passes, the ranks agree on what any of them
# received -- an all-reduce (MAX) of ``world_size + 1`` small integers, so ranks signalled at different moments agree
# too -- and then, all at the same step boundary:
#
# - the requeue signal: every rank runs Lightning's own handler (the HPC checkpoint, written collectively; then rank 0
#   runs ``scontrol requeue``), and training goes on until the scheduler stops the job;
# - SIGTERM: the ranks that received it leave with Lightning's ``SIGTERMException`` (exit status 143, a process ended by
#   SIGTERM), the others raise :class:`PeerTerminatedError` naming them. Callbacks' ``on_exception`` runs on every rank
#   at the same point, so a save there (Lightning's ``OnExceptionCheckpoint``) is collective too.
#
# What this gives up: a signal still unread when training ends is acted on at ``on_train_end`` (the requeue) or not at
# all (SIGTERM: training is done); Lightning's SIGTERM handler itself is not run (its in-handler broadcast is the hang),
# so neither is a SIGTERM handler installed before the Trainer's, which Lightning chains into it. Outside ``fit``
# (``validate``, ``test``, ``predict``) Lightning's handlers run as they are.
class DeferredSignals(Callback):
    """Records the requeue signal and SIGTERM during ``fit`` and acts on them at batch ends, on every rank together.

    See [Note: deferred signals]. Added to ``trainer.callbacks`` by :meth:`install`, taken out by :meth:`remove`.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._requeue_signal = _requeue_signal(trainer)
        self._handlers: dict[int, Handler] = {}  # Lightning's handlers, run when every rank agrees
        self._received: set[int] = set()
        self._in_flight: Agreement | None = None  # this batch's flags, sent before its optimizer step

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
        self._in_flight = None  # a fit that raised between the send and the batch end: nothing acts on it any more
        interrupt_waits(None)
        if self in self._trainer.callbacks:
            self._trainer.callbacks.remove(self)

    # [Note: SIGTERM in a wait that does not end] A rank that waits for a peer that never comes (stuck in its data
    # loader, in a collective of its own, gone quiet) never reaches a batch end, so a SIGTERM it records would wait for
    # the process group's timeout. So the handler also arms ``interrupt_waits`` (``engine/diagnostics/hang_watch.py``):
    # a wait of ours that has lasted ``STUCK_WAIT_S`` (or already had when the signal came) raises ``SIGTERMException``
    # (exit status 143), and the peers see this rank leave at their next wait and stop too (``PeerExitedError``). Waits
    # shorter than that end as usual, so in a healthy step the signal is still acted on at the batch end by every rank
    # together, where a save in ``on_exception`` can be collective. The batch-end agreement itself waits this way too.
    # ``STUCK_WAIT_S`` is far above a healthy wait here (a unit's gather, or a peer's skew within a step) and far below
    # SLURM's ``KillWait`` (30 s by default) between SIGTERM and SIGKILL.
    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received.add(signum)  # little else here: this runs in the middle of whatever the main thread does
        if signum == signal.SIGTERM:  # see [Note: SIGTERM in a wait that does not end]
            interrupt_waits(SIGTERMException(SIGTERM_EXIT_STATUS), after_waiting_s=STUCK_WAIT_S)

    # [Note: agreement behind the optimizer step] A blocking all-reduce at every batch end would cost the step one round
    # trip through the collective's backend, which on a loaded CPU host takes milliseconds, the wait for the slower rank
    # aside. So each rank sends its flags late in the batch, in the background (``async_op=True``): at the batch's first
    # ``on_before_optimizer_step``, after backward and before the optimizer updates the shards. It waits for the result
    # at ``on_train_batch_end``, so the round trip runs while the optimizer steps (and the gradients are clipped, and
    # zeroed), and every rank acts at the end of the batch the signal arrived in, on the same result. Exactly one flags
    # all-reduce per batch on every rank, waited for at that batch's end, nothing in flight between batches:
    #
    # - A signal that lands after this rank sent its flags (inside the optimizer step, or in a manual-optimization
    #   ``training_step`` after its first ``optimizer.step()``) stays recorded and goes with the next batch's flags:
    #   acted on at the end of the next batch, never lost.
    # - A batch without an optimizer step (the micro-batches of gradient accumulation before the last; a manual
    #   optimization step that did not step) sends its flags at ``on_train_batch_end`` and waits for them there: one
    #   blocking round trip on that batch, so it too acts on its own signals. (Were ranks ever to differ in whether a
    #   batch stepped, each still issues its one all-reduce of the batch, at whichever point, and the two pair up.)
    # - The end of training: a signal that landed after the last batch's flags were sent is agreed on at
    #   ``on_train_end``, with one blocking all-reduce.
    #
    # ``benchmarks/bench_signals.py`` measures what is left on the step: issuing the all-reduce, and the wait at the
    # batch end for whatever of the round trip the optimizer step did not cover.
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # The batch's first optimizer step (manual optimization may step several, LBFGS re-runs its closure): the
        # round trip runs while the optimizer updates the shards. See [Note: agreement behind the optimizer step].
        if self._in_flight is None:
            self._in_flight = self._send()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._act(*self._agree(self._sent()), stop_on_sigterm=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # What landed after the last batch's flags were sent: one blocking all-reduce. Training is done, so a
        # SIGTERM has nothing left to stop.
        self._act(*self._agree(self._sent()), stop_on_sigterm=False)
        self.remove()

    def _act(self, requeue: bool, terminated: list[int], stop_on_sigterm: bool) -> None:
        if requeue:
            assert self._requeue_signal is not None
            log.info("requeue signal: every rank saves the HPC checkpoint after step %d", self._trainer.global_step)
            with self._trainer.strategy.saves_complete_on_return():  # the job may end as soon as the handler returns
                self._handlers[self._requeue_signal](self._requeue_signal, inspect.currentframe())
        if terminated and stop_on_sigterm:
            self._stop(terminated)

    def _sent(self) -> Agreement:
        """This batch's agreement, taken out: the one its optimizer step sent, else sent now (no step: the caller's
        wait is a blocking round trip)."""
        agreement, self._in_flight = self._in_flight or self._send(), None
        return agreement

    def _send(self) -> Agreement:
        """Issue the all-reduce of the signals this rank received since its last send, in the background."""
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        flags = [0] * (world_size + 1)
        flags[0] = int(self._take(self._requeue_signal))
        flags[1 + (dist.get_rank() if world_size > 1 else 0)] = int(self._take(signal.SIGTERM))
        local = torch.tensor(flags, dtype=torch.int32, device=self._trainer.strategy.root_device)
        if world_size == 1:
            return Agreement(None, local)
        return Agreement(dist.all_reduce(local, op=dist.ReduceOp.MAX, async_op=True), local)

    def _agree(self, agreement: Agreement) -> tuple[bool, list[int]]:
        """Wait for ``agreement``: what every rank acts on (a method of its own so a benchmark can time the wait)."""
        return agreement.wait()

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
