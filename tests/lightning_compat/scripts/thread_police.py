"""Lightning's check that a test leaves no thread behind, for the ported tests: in pytest's process (``conftest.py``)
and, per case, inside the ranks of ``fsdp_trainer_runs.py``, where the threads a strategy starts live.

Ported from the ``thread_police_duuu_daaa_duuu_daaa`` fixture of Lightning's ``tests/tests_pytorch/conftest.py``
(Apache-2.0): the threads started since the test began are stopped or waited for where Lightning lets them go (a
daemon thread with a ``stop``/``exit`` method, torch.compile's and tqdm's, executors', fsspec's), and any other fails
the test with Lightning's sentence, ``Test left zombie thread: <thread>``. Two differences, both marked below: a
thread of ours (``lightning_fsdp-*``) always fails, where Lightning's fixture would stop a daemon one that has a
``stop`` method and pass (a thread of ours alive after the run's teardown is what this check is for); and the
launcher's observer of its child processes is left to run, where Lightning's fixture joins it for up to 10 s (it
watches rank 1 until the process ends, so that join always times out and passes).
"""

from __future__ import annotations

import threading
from concurrent.futures.process import _ExecutorManagerThread

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from tqdm import TMonitor

OURS = "lightning_fsdp"  # the prefix of every thread name of ours


def check_threads_since(before: set[threading.Thread]) -> None:
    """Raise ``AssertionError`` for a thread started since ``before`` that Lightning's test suite would fail a test
    for, or one of ours; stop or wait for the ones it lets go."""
    for thread in set(threading.enumerate()) - before:
        if thread.name.startswith(OURS):  # ours: stricter than Lightning's fixture (see the module's docstring)
            raise AssertionError(f"Test left zombie thread: {thread}")
        stop = getattr(thread, "stop", None) or getattr(thread, "exit", None)
        if thread.daemon and callable(stop):
            stop()
            assert not thread.is_alive()
        elif isinstance(thread, _ChildProcessObserver):
            continue  # Lightning's fixture joins it for up to 10 s (see the module's docstring)
        elif thread.name in ("QueueFeederThread", "QueueManagerThread") or "(_read_thread)" in thread.name:
            thread.join(timeout=20)
        elif isinstance(thread, TMonitor):
            thread.exit()
        elif isinstance(thread, _ExecutorManagerThread) or "ThreadPoolExecutor-" in thread.name:
            continue
        elif thread.name == "fsspecIO":
            continue
        else:
            raise AssertionError(f"Test left zombie thread: {thread}")
