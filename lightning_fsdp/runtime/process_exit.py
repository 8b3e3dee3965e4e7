"""Leaving a process that used gloo without the interpreter's shutdown, once its work is done.

[Note: gloo exit race] A gloo worker thread drops its reference to a finished collective's work object a moment
after the waiting thread has been released, and with it the tensors the work held. When the main thread has
meanwhile reached interpreter shutdown, that release needs the GIL, the thread is told to exit while unwinding
through C++, and the process dies with SIGABRT ("terminate called without an active exception"; seen in core dumps
under ``ProcessGroupGloo`` work destructors in ``Py_FinalizeEx``), after a run that succeeded and wrote everything.
``destroy_process_group`` does not join those threads; ``os._exit`` skips the shutdown. Every entry point that ends
a distributed run (the CLI, the examples, the benchmarks, the test ranks) leaves through here.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def exit_after_distributed_run() -> None:
    """End the process now (status 0) if it joined a process group; otherwise return and exit normally.

    Call it only after success, with everything written: nothing after it runs, not even ``atexit`` handlers.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_now() -> None:
    """End the process now (status 0), whether or not a process group is still up (it may have been destroyed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
