"""A rank that fails mid-fit must not leave the others hanging: they exit with an error within the strategy's
timeout (tests/scripts/strategy_fault.py; both ranks started here, without Lightning's launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_fsdp.runtime.launch import free_port
from tests.strategy_scripts import SCRIPTS

STRATEGY_TIMEOUT_S = 20  # as in the script
BOUND_S = 180  # the subprocess bound: a hang would run into it


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_a_failed_rank_makes_the_other_exit_with_an_error_within_the_timeout(tmp_path: Path, mode: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, str(SCRIPTS / "strategy_fault.py"), str(tmp_path), mode]
    ranks = [
        subprocess.Popen(command, env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in (0, 1)
    ]
    try:
        output, _ = ranks[0].communicate(timeout=BOUND_S)
        exited_at = time.time()
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    text = output.decode(errors="replace")
    assert ranks[0].returncode != 0, f"rank 0 finished normally:\n{text[-3000:]}"
    waited = exited_at - float((tmp_path / "failed_at").read_text())
    assert waited < STRATEGY_TIMEOUT_S + 10, f"rank 0 took {waited:.1f} s to give up:\n{text[-3000:]}"
    assert "Error" in text, text[-3000:]
    if mode == "kill":
        assert ranks[1].returncode == -9
    else:
        assert waited > STRATEGY_TIMEOUT_S - 1, f"rank 0 gave up after {waited:.1f} s, before any timeout"
        assert "Timed out" in text, text[-3000:]
