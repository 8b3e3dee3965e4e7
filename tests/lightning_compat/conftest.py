"""The autouse fixtures of Lightning's ``tests/tests_pytorch/conftest.py`` (Apache-2.0) that its FSDP tests run under,
ported for the tests of this folder: what a test leaves behind (threads, environment variables, signal handlers, the
process group, files in the test tree, the rank of ``rank_zero_only``) fails it or is put back, as in Lightning's
suite. The Trainer cases run in the ranks of ``scripts/fsdp_trainer_runs.py``, which checks threads after each case
with the same function (``scripts/thread_police.py``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from tests.lightning_compat.scripts.thread_police import check_threads_since

# Lightning's list of variables that tests may leave set (its "known leakers"), as in its conftest.
_ENVIRONMENT_ALLOWLIST = {
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_DEVICE_ORDER",
    "LOCAL_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "WANDB_MODE",
    "WANDB_REQUIRE_SERVICE",
    "WANDB_SERVICE",
    "RANK",
    "CUDA_MODULE_LOADING",
    "KMP_INIT_AT_FORK",
    "KMP_DUPLICATE_LIB_OK",
    "CRC32C_SW_MODE",
    "TRITON_CACHE_DIR",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "OMP_NUM_THREADS",
    "TORCHINDUCTOR_CACHE_DIR",
}


@pytest.fixture(autouse=True)
def preserve_global_rank_variable() -> Iterator[None]:
    """The rank ``rank_zero_only`` reads is put back after each test."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only as rank_zero_only_fabric
    from lightning.pytorch.utilities.rank_zero import rank_zero_only as rank_zero_only_pytorch
    from lightning_utilities.core.rank_zero import rank_zero_only as rank_zero_only_utilities

    functions = (rank_zero_only_pytorch, rank_zero_only_fabric, rank_zero_only_utilities)
    ranks = [getattr(fn, "rank", None) for fn in functions]
    yield
    for fn, rank in zip(functions, ranks, strict=True):
        if rank is not None:
            fn.rank = rank


@pytest.fixture(autouse=True)
def restore_env_variables() -> Iterator[None]:
    """A variable a test sets and leaves set fails it (but for Lightning's allowlist); the environment is put back."""
    backup = os.environ.copy()
    yield
    leaked = os.environ.keys() - backup.keys() - _ENVIRONMENT_ALLOWLIST
    os.environ.clear()
    os.environ.update(backup)
    assert not leaked, f"test is leaking environment variable(s): {set(leaked)}"


@pytest.fixture(autouse=True)
def restore_signal_handlers() -> Iterator[None]:
    """The handlers of every signal a Trainer may take over are put back after each test."""
    valid_signals = _SignalConnector._valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    handlers = {signum: signal.getsignal(signum) for signum in valid_signals}
    yield
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def teardown_process_group() -> Iterator[None]:
    """A process group a test made is destroyed before the next test."""
    yield
    _destroy_dist_connection()


@pytest.fixture(autouse=True)
def reset_deterministic_algorithm() -> Iterator[None]:
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(autouse=True)
def thread_police_duuu_daaa_duuu_daaa() -> Iterator[None]:
    """A thread a test leaves alive fails it (``Test left zombie thread: ...``), as in Lightning's suite."""
    before = set(threading.enumerate())
    yield
    check_threads_since(before)


@pytest.fixture(autouse=True)
def leave_no_artifacts_behind() -> Iterator[None]:
    """A file a test leaves in the test tree fails it."""
    tests_root = Path(__file__).parent.parent
    files_before = {p for p in tests_root.rglob("*") if "__pycache__" not in p.parts}
    yield
    files_after = {p for p in tests_root.rglob("*") if "__pycache__" not in p.parts}
    difference = {str(f.relative_to(tests_root)) for f in files_after - files_before}
    assert not difference, f"Test left artifacts behind: {difference}"
