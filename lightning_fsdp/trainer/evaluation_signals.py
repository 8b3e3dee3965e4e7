"""SIGTERM during ``validate``, ``test`` and ``predict``: the run ends within seconds on every rank, waiting or not.

Lightning's own SIGTERM handler broadcasts from rank 0 inside the handler, wherever the main thread is: during
evaluation that is usually inside a unit's gather, where the broadcast waits for peers that are in the gather, and
both wait until the process group's timeout. Outside ``fit`` (whose handling is ``preemption.py``'s) this handler
takes its place: it records what Lightning's would (``trainer.received_sigterm``, on which Lightning's evaluation
loop raises ``SIGTERMException`` at the next batch end) and makes a wait that has gone on for a while raise it at
once (see [Note: every wait knows where its peers are] in ``engine/diagnostics/hang_watch.py``): a rank stuck waiting
for a peer never reaches a batch end. The peers see it exit within a second and stop too.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_fsdp.engine.diagnostics.hang_watch import interrupt_waits

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM


class EvaluationSignals:
    """Installed by the strategy at the start of an evaluation or prediction run, removed at its end."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._previous = signal.getsignal(signal.SIGTERM)

    @classmethod
    def install(cls, trainer: pl.Trainer) -> EvaluationSignals | None:
        """None where signals cannot be handled (not the main thread, as in Lightning's own registration)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        installed = cls(trainer)
        signal.signal(signal.SIGTERM, installed._record)
        return installed

    def remove(self) -> None:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == self._record:
            signal.signal(signal.SIGTERM, self._previous)
        interrupt_waits(None)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._trainer._signal_connector.received_sigterm = True
        interrupt_waits(SIGTERMException(SIGTERM_EXIT_STATUS))
