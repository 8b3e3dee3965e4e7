"""Run a Trainer script from tests/scripts/ on 2 Lightning processes and fail with its output.

Lightning's launcher starts the other ranks by running the command line again, so a multi-process Trainer cannot
run inside pytest's own process: the strategy tests run scripts and read what they wrote into a folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(name: str, out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run tests/scripts/<name> OUT [ARGS...]; one thread per process (2 share this machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPTS / name), str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return result
