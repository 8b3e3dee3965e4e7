"""Run multi-process Lightning commands from tests and fail with their output.

Lightning's launcher starts the other ranks by running the command line again, so a multi-process Trainer cannot
run inside pytest's own process: the strategy tests run scripts and read what they wrote into a folder, and the CLI
and example tests run their commands in a session of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(name: str, out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run tests/scripts/<name> OUT [ARGS...]; one thread per process (2 share this machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPTS / name), str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result


def run_in_session(command: list[str], cwd: Path, timeout: float, label: str) -> str:
    """Run ``command`` in a session of its own and return its output; fail the test unless it exits with 0.

    The session lets a timeout kill every rank the launcher started, not only the first one.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPTS.parents[1])}
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{label} did not finish within {timeout:g} s:\n{output}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the other rank, should it outlive rank 0
        except ProcessLookupError:
            pass
    assert process.returncode == 0, f"{label} exited with {process.returncode}:\n{output}"
    return output
