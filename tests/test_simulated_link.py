"""Only what must cross the link, and no more: two simulated hosts in a network namespace this test makes, each
sending to the other through a NIC of its own (``tests/simulated_link.py``), the bytes that crossed per step counted
by the NICs and held against the arithmetic of each mode (see [Note: two stages] in transport/hierarchical.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "link_bytes.py"
# Stamps and digests beside the tensors (the sockets count payload only): about 1% on this model.
SLACK = 0.10


def _namespaces_unavailable() -> str | None:
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 and util-linux make the simulated link)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here (needs root): {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def crossed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    reason = _namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("link_bytes")
    script = 'ip link set lo up && hostname simnet && exec "$@"'
    command = ["unshare", "--net", "--uts", "bash", "-c", script, "bash", sys.executable, str(SCRIPT), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=480, env=env)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return {w: json.loads((out / f"link_bytes_{w}.json").read_text()) for w in (4, 2)}


def _model_bytes(case: dict) -> tuple[float, float]:
    """S, every parameter's (padded) bytes, and the blocks backward gathers again: all but the last three, which stay
    gathered from forward (the last one and the two backward prefetches at once: see [Note: the last unit stays
    gathered] in runtime/root.py)."""
    blocks = case["block_bytes"]
    return case["root_bytes"] + sum(blocks), sum(blocks[:-3])


def _expected(name: str, case: dict) -> float:
    """Bytes one host sends the other per step, two hosts: a gather sends half of what it gathers, so does a
    reduce-scatter, and an all-reduce of a shard over two replicas all of that shard."""
    total, regathered = _model_bytes(case)
    full_shard = total / 2 + regathered / 2 + total / 2  # forward's gathers, backward's, the reduce-scatters
    return {
        "full_shard": full_shard,
        "full_shard_bf16": full_shard / 2,
        "full_shard_to_host": total,  # backward gathers inside the host
        "full_shard_kept": total,
        "hybrid": total,  # each of a host's two ranks all-reduces its half with its replica
        "hybrid_bf16": total / 2,
    }[name]


@pytest.mark.parametrize(
    ("world_size", "name"),
    [(4, n) for n in ("full_shard", "full_shard_to_host", "hybrid", "hybrid_bf16", "full_shard_bf16")]
    + [(2, n) for n in ("full_shard", "full_shard_kept")],
)
def test_bytes_between_hosts_are_what_the_mode_must_send(crossed: dict, world_size: int, name: str) -> None:
    case = crossed[world_size][name]
    expected = _expected(name, case)
    measured = case["crossed_per_step_per_host"]
    assert expected * (1 - SLACK / 4) < measured < expected * (1 + SLACK), (name, measured, expected)


def test_an_untied_embedding_crosses_by_its_rows(crossed: dict) -> None:
    """Untied, the embedding's weight is gathered by the rows 64 tokens look up and its gradient sent by the rows they
    touched: of the embedding's share of the arithmetic (half of it gathered, half reduced) almost nothing crosses."""
    case = crossed[2]["full_shard_untied"]
    embedding, measured = case["embedding_bytes"], case["crossed_per_step_per_host"]
    dense = _expected("full_shard", case)
    assert dense - 1.1 * embedding < measured < dense - 0.5 * embedding, (measured, dense, embedding)


@pytest.mark.parametrize("name", ["full_shard", "full_shard_to_host", "hybrid"])
def test_nothing_inside_a_host_goes_over_tcp(crossed: dict, name: str) -> None:
    """Two ranks of one host talk through shared memory: their TCP connections carry next to nothing."""
    case = crossed[4][name]
    inside = case["inside_per_step_per_host"]
    assert inside < 0.01 * case["crossed_per_step_per_host"], (name, inside)


def test_the_inside_counter_sees_tcp_inside_a_host(crossed: dict) -> None:
    """The control of the test above: with shared memory switched off, the host stage of the same collectives goes
    over TCP between the host's two ranks, and the counter sees about as much inside as crossed."""
    case = crossed[4]["full_shard_without_shared_memory"]
    assert case["inside_per_step_per_host"] > 0.5 * case["crossed_per_step_per_host"], case
    assert crossed[4]["full_shard"]["crossed_per_step_per_host"] == pytest.approx(
        case["crossed_per_step_per_host"], rel=SLACK
    )
