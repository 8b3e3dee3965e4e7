"""Two claimed nodes on one host, as torchrun starts them (one agent per node, static rendezvous): shared memory
inside every process group whose ranks share the host -- HYBRID_SHARD's shard and replica groups, FULL_SHARD over
both nodes -- and training equal to the unsharded model's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from lightning_fsdp.runtime.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "two_nodes.py"


def test_two_claimed_nodes_on_one_host_share_memory_in_every_group(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(2):
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 -- closed below, after the agent has exited
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(SCRIPT), "HYBRID_SHARD", "FULL_SHARD",
        ]  # fmt: skip
        agents.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path), log))
    try:
        codes = _wait_failing_fast([agent for agent, _ in agents], timeout=240)
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()
    output = "\n".join((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert codes == [0, 0], output[-6000:]
    # The ranks of one agent share its output, so two ranks' lines may interleave: look for the words, not lines.
    assert sorted(re.findall(r"rank \d ok", output)) == [f"rank {r} ok" for r in range(4)], output[-6000:]


def _wait_failing_fast(agents: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Every agent's exit code; as soon as one fails, the others are not waited for (their peers are gone, and
    torchrun's agent of the other node would wait for them until its own timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            return codes
        try:
            agents[codes.index(None)].wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    return [agent.poll() for agent in agents]
