"""Two claimed nodes on one host, as torchrun starts them (one agent per node, static rendezvous): shared memory
inside every process group whose ranks share the host -- HYBRID_SHARD's shard and replica groups, FULL_SHARD over
both nodes -- and training equal to the unsharded model's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lightning_fsdp.launch import free_port

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
        codes = [agent.wait(timeout=240) for agent, _ in agents]
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            log.close()
    output = "\n".join((tmp_path / f"node{node}.log").read_text() for node in range(2))
    assert codes == [0, 0], output[-6000:]
    assert sorted(line for line in output.splitlines() if line.endswith(" ok")) == [f"rank {r} ok" for r in range(4)]
