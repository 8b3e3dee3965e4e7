"""One rank of a run over two claimed nodes of two ranks each, on one host (started by tests/test_two_nodes.py
through two torchrun agents): every process group whose ranks share the host moves its data through shared memory,
and training equals the unsharded model's."""

from __future__ import annotations

import contextlib
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_fsdp import fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport


def check(strategy: str) -> None:
    config = GPTConfig(vocab_size=509, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(0)
    mesh = {"device_mesh": (2, 2)} if strategy == "HYBRID_SHARD" else {}
    model = fully_shard(GPT(config), {Block}, sharding_strategy=strategy, **mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # every rank the same batch: the average over ranks is the unsharded model's gradient
        for m, optimizer in zip((reference, model), optimizers, strict=True):
            with CollectiveCounter() if m is model else contextlib.nullcontext() as counter:
                m(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()
    with summon_full_params(model):
        for (name, full), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")
    transports = [t for t in units_under(model)[0].context.transports.values() if t.world_size > 1]
    expected_sizes = [2, 2] if strategy == "HYBRID_SHARD" else [4]
    assert [t.world_size for t in transports] == expected_sizes, transports
    assert all(isinstance(t, SharedMemoryTransport) for t in transports), f"{strategy}: {transports}"
    over_gloo = [event.op for event in counter.events if not event.op.startswith("shm::")]
    assert over_gloo == [], f"{strategy}: ranks of one host exchanged {over_gloo} over gloo"


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    for strategy in sys.argv[1:]:
        check(strategy)
    print(f"rank {dist.get_rank()} ok", flush=True)
    dist.barrier()  # no rank tears its group down while another still uses it
    dist.destroy_process_group()
