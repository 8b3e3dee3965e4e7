"""The multi-process helper must pass a correct run, and turn a failing or hanging rank into a fast, clear
test failure with no process left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _all_reduce_sums_ranks(rank: int, world_size: int, offset: float) -> None:
    tensor = torch.tensor([rank + offset])
    dist.all_reduce(tensor)
    expected = sum(r + offset for r in range(world_size))
    assert tensor.item() == expected, f"rank {rank}: all_reduce gave {tensor.item()}, expected {expected}"


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom")
    # Rank 0 waits in a collective rank 1 never enters: the helper must not wait for it to time out.
    dist.barrier()


def _leave_with_an_error_status() -> None:
    sys.exit(3)  # as argparse or a library's fatal-error path does


def _rank_one_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        _leave_with_an_error_status()
    dist.barrier()


def _rank_one_is_killed(rank: int, world_size: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    dist.barrier()


def _rank_zero_hangs(rank: int, world_size: int, pid_file: str) -> None:
    if rank == 0:
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(1000)


def _rank_reports_its_environment(rank: int, world_size: int, variable: str, expected: str) -> None:
    assert os.environ.get(variable) == expected, f"rank {rank}: {variable}={os.environ.get(variable)!r}"
    print(f"rank {rank} to stdout", flush=True)
    print(f"rank {rank} to stderr", file=sys.stderr, flush=True)


def test_all_reduce_on_two_ranks_passes() -> None:
    run_distributed(_all_reduce_sums_ranks, 2, 10.0, timeout=60.0)


def test_ranks_run_in_the_callers_current_environment_and_write_to_its_streams(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Set after the ranks' fork server may have started (an earlier test started it): the ranks must see it all
    # the same, and print into this test's capture, not into the one that was current when the server started.
    value = f"set-by-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("LIGHTNING_FSDP_HELPER_CHECK", value)
    run_distributed(_rank_reports_its_environment, 2, "LIGHTNING_FSDP_HELPER_CHECK", value, timeout=60.0)
    out, err = capfd.readouterr()
    for rank in range(2):
        assert f"rank {rank} to stdout" in out
        assert f"rank {rank} to stderr" in err


def test_a_rank_that_raises_fails_fast_with_its_traceback() -> None:
    start = time.monotonic()
    # Rank 0's barrier fails too once rank 1 is gone; the cause must come first all the same.
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 raised:") as info:
        run_distributed(_rank_one_raises, 2, timeout=120.0)
    message = str(info.value)
    assert "ValueError: boom" in message
    assert "_rank_one_raises" in message  # the rank's own traceback, not only the exception text
    assert time.monotonic() - start < 60.0


def test_a_rank_that_calls_sys_exit_fails_fast_with_where_it_did() -> None:
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 raised:") as info:
        run_distributed(_rank_one_exits, 2, timeout=120.0)
    message = str(info.value)
    assert "rank 1 called sys.exit(3)" in message
    assert "_leave_with_an_error_status" in message  # the traceback of the SystemExit itself


def test_a_rank_killed_by_a_signal_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 died: killed by signal SIGKILL"):
        run_distributed(_rank_one_is_killed, 2, timeout=120.0)
    assert time.monotonic() - start < 60.0


def test_a_hanging_rank_is_killed_after_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    pid_file = tmp_path / "hanging_rank.pid"
    # The hanging rank 0 is always named. Rank 1 has nothing to do, but on a loaded shared machine its start-up alone
    # (importing torch in a fresh process) can outlast the deadline, and then it is named as well.
    with pytest.raises(TimeoutError, match=r"ranks \[0(, 1)?\] did not finish within 20 s: probably a hang"):
        run_distributed(_rank_zero_hangs, 2, str(pid_file), timeout=20.0)
    assert time.monotonic() - start < 40.0
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(int(pid_file.read_text()), 0)


def test_a_local_function_is_refused_before_spawning() -> None:
    def local(rank: int, world_size: int) -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local, 2)
