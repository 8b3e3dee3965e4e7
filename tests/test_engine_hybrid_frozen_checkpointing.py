"""HYBRID_SHARD, frozen parameters, activation checkpointing and CPU offload: parity and counted bytes."""

from __future__ import annotations

import torch

from lightning_fsdp import apply_activation_checkpointing, fully_shard
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT, Run, data_moving, reduce_scatter_kind, run_parity
from tests.test_engine_comm import FP32, _unit_shard_numels

HYBRID = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}
FROZEN = ("wte", "blocks.0.attn", "blocks.1.mlp.fc.weight")  # frozen and trainable parameters share units


def _hybrid_runs(rank: int, world_size: int) -> None:
    for run in (
        Run(shard=HYBRID),
        Run(shard={**HYBRID, "backward_prefetch": "BACKWARD_POST", "forward_prefetch": True}),
        Run(shard=HYBRID, clip_norm=0.05),
        Run(shard=HYBRID, clip_norm=0.01, norm_type=float("inf")),
        Run(shard=HYBRID, steps=3, accumulate=2, skip_sync=True),
        Run(shard=HYBRID, freeze=FROZEN),
        Run(shard=HYBRID, checkpointing=True),
    ):
        run_parity(rank, world_size, run)
    _check_hybrid_bytes(world_size)


def _check_hybrid_bytes(world_size: int) -> None:
    """Rows spread over the shard group of 2; the reduced shard all-reduced over the replicate group of 2."""
    shard_numels = _unit_shard_numels(GPT(TINY_GPT), 2)
    model = fully_shard(GPT(TINY_GPT), {Block}, **HYBRID)
    tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
    with CollectiveCounter() as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    by_kind: dict[str, set[int | None]] = {}
    for event in counter.events:
        by_kind.setdefault(event.kind, set()).add(event.group_size)
    reduce = reduce_scatter_kind()
    assert data_moving(by_kind) == {"all_gather": {2}, reduce: {2}, "all_reduce": {2}}, f"groups: {by_kind}"
    assert counter.counts["all_reduce"] == len(shard_numels), "one replica all-reduce per unit"
    assert counter.bytes["all_reduce"] == sum(shard_numels) * FP32, "the replicas all-reduce the shard, not more"
    assert counter.bytes[reduce] == 2 * sum(shard_numels) * FP32


def _frozen_checkpointing_offload_runs(rank: int, world_size: int) -> None:
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for run in (
            Run(shard={"sharding_strategy": strategy}, freeze=FROZEN),
            Run(shard={"sharding_strategy": strategy}, checkpointing=True),
            Run(shard={"sharding_strategy": strategy}, checkpointing=True, accumulate=2, steps=3),
            Run(shard={"sharding_strategy": strategy, "cpu_offload": True}),
        ):
            run_parity(rank, world_size, run)
    _check_frozen_bytes(world_size)


def _check_frozen_bytes(world_size: int) -> None:
    """Frozen parameters take no place in the reduce-scatter and get no gradient storage."""

    def reduce_bytes(freeze: tuple[str, ...]) -> int:
        model = GPT(TINY_GPT)
        for name, param in model.named_parameters():
            param.requires_grad_(not name.startswith(freeze))
        fully_shard(model, {Block})
        tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1))
        with CollectiveCounter() as counter:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        frozen = [p for name, p in model.named_parameters() if name.startswith(freeze)]
        assert all(p.grad is None for p in frozen), "a frozen parameter got gradient storage"
        return counter.bytes[reduce_scatter_kind()]

    model = GPT(TINY_GPT)
    frozen_numel = sum(
        -(-p.shape[0] // world_size) * (p.numel() // p.shape[0])
        for n, p in model.named_parameters()
        if n.startswith(FROZEN)
    )
    assert reduce_bytes(()) - reduce_bytes(FROZEN) == world_size * frozen_numel * FP32


def _saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if not isinstance(tensor, torch.nn.Parameter):
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return saved


def _check_checkpointing_memory(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # every rank builds the same model
    config = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=2, n_embd=32)
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1))
    plain = fully_shard(GPT(config), {Block})
    checkpointed = apply_activation_checkpointing(fully_shard(GPT(config), {Block}), {Block})
    without, with_checkpointing = _saved_activation_bytes(plain, tokens), _saved_activation_bytes(checkpointed, tokens)
    assert with_checkpointing < 0.4 * without, f"saved activations {with_checkpointing} B vs {without} B unchecked"


def test_hybrid_shard_parity_and_groups_on_four_ranks() -> None:
    run_distributed(_hybrid_runs, 4, timeout=600)


def test_frozen_parameters_checkpointing_and_offload_parity() -> None:
    run_distributed(_frozen_checkpointing_offload_runs, 2, timeout=600)


def test_activation_checkpointing_saves_less() -> None:
    run_distributed(_check_checkpointing_memory, 2)
