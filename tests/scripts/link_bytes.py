"""What crosses between two simulated hosts per step, for each way of sharding 4 ranks as 2 hosts x 2 (and 2 x 1):
run as root inside a network namespace of its own (``tests/test_simulated_link.py``). Writes OUT/link_bytes.json."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_fsdp import fully_shard  # noqa: E402
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig  # noqa: E402
from lightning_fsdp.engine.runtime.registry import unit_of  # noqa: E402
from lightning_fsdp.engine.transport.hosts import HOST_SWITCH  # noqa: E402
from lightning_fsdp.engine.transport.shm import ENV_SWITCH as SHARED_MEMORY_SWITCH  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.simulated_link import HostLink, install_link  # noqa: E402

# Large enough that what a step moves dwarfs the connections' own traffic, small enough for seconds a case.
MODEL = GPTConfig(vocab_size=512, block_size=32, n_layer=5, n_head=4, n_embd=64)
WARMUP, STEPS = 2, 3
CASES = {
    4: {
        "full_shard": {},
        "full_shard_to_host": {"reshard_after_forward": 2},
        "hybrid": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)},
        "hybrid_bf16": {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2), "cross_host_precision": "bf16"},
        "full_shard_bf16": {"cross_host_precision": "bf16"},
        "full_shard_without_shared_memory": {},  # the control: the inside class sees what goes over TCP in a host
    },
    2: {"full_shard": {}, "full_shard_kept": {"reshard_after_forward": 1}, "full_shard_untied": {}},
}
# The cases of another model: an untied embedding crosses by the rows its lookups and its gradient touch.
CONFIGS = {"full_shard_untied": dataclasses.replace(MODEL, tie_weights=False)}


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, world_size: int, out: str) -> None:
    per_host = world_size // 2
    os.environ[HOST_SWITCH] = f"simhost{rank // per_host}"
    pids: list[int | None] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    link = HostLink()
    data = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.block_size + 1), generator=data)
    results = {}
    for case, shard in CASES[world_size].items():
        os.environ[SHARED_MEMORY_SWITCH] = "0" if case.endswith("without_shared_memory") else "1"
        torch.manual_seed(0)
        model = GPT(CONFIGS.get(case, MODEL))
        fully_shard(model, {Block}, **shard)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(WARMUP):  # every connection of the case exists after its first step
            _step(model, optimizer, tokens)
        # Rank 0 reads the counters while every rank waits in a barrier on either side: a peer's first or next
        # sends would otherwise reach its sockets, and the counters, before or after the reading.
        if rank == 0:
            link.classify({pid: r // per_host for r, pid in enumerate(pids)})
            crossed, inside = link.sent_bytes()
        dist.barrier()
        for _ in range(STEPS):
            _step(model, optimizer, tokens)
        dist.barrier()
        if rank == 0:
            crossed_after, inside_after = link.sent_bytes()
        dist.barrier()
        if rank != 0:
            continue
        root = unit_of(model)
        results[case] = {
            "crossed_per_step_per_host": (crossed_after - crossed) / STEPS / 2,
            "inside_per_step_per_host": (inside_after - inside) / STEPS / 2,
            "root_bytes": sum(p.layout.padded_numel * 4 for p in root.params),
            "embedding_bytes": sum(p.layout.padded_numel * 4 for p in root.params if p.fqn == "wte.weight"),
            "block_bytes": [sum(p.layout.padded_numel * 4 for p in u.params) for u in root.context.units[1:]],
        }
    if rank == 0:
        Path(out, f"link_bytes_{world_size}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    out = sys.argv[1]
    install_link(hosts=2, rate=sys.argv[2] if len(sys.argv) > 2 else "1gbit")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the namespace's only interface
    for world_size in CASES:
        run_distributed(_rank, world_size, out, timeout=240)


if __name__ == "__main__":
    main()
