"""A unit's gradients that arrive while other units' backward runs are reduced at once (the root's output head).

See [Note: gradients that arrive long before their unit's backward ends] in lightning_fsdp/engine/runtime/root.py.
Reducing part of a unit early changes what is summed with what in no element (every element is still the sum over
ranks of the same addends), so training with it must equal training without it bit for bit, under every option; and
the sharded run must still match the unsharded one.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_fsdp import MixedPrecision, apply_activation_checkpointing, fully_shard, no_sync, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.diagnostics.comm_stats import CollectiveCounter
from lightning_fsdp.engine.runtime import unit
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.transport import shm
from tests.distributed import run_distributed
from tests.engine_harness import Run, reduce_scatter_kind, run_parity

# An LLM's proportions in miniature: an untied embedding and head in the root, each over EARLY_REDUCTION_MIN_BYTES
# (4099 x 64 fp32 = 1.05 MB), 4099 rows dividing by neither 2 nor 4.
LLM_ROOT = GPTConfig(vocab_size=4099, block_size=16, n_layer=2, n_head=2, n_embd=64, bias=True, tie_weights=False)
TIED_ROOT = GPTConfig(vocab_size=4099, block_size=16, n_layer=2, n_head=2, n_embd=64, bias=True, tie_weights=True)
HYBRID = {"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 2)}
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)


def _train(
    world_size: int,
    rank: int,
    shard: dict,
    early: bool,
    accumulate: int = 1,
    freeze: str = "",
    checkpointing: bool = False,
) -> dict[str, torch.Tensor]:
    """Three steps of LLM_ROOT sharded; the full weights after them."""
    saved = unit.EARLY_REDUCTION_MIN_BYTES
    unit.EARLY_REDUCTION_MIN_BYTES = saved if early else 1 << 62
    try:
        torch.manual_seed(0)
        model = GPT(LLM_ROOT)
        if freeze:
            model.get_submodule(freeze).requires_grad_(False)
        fully_shard(model, {Block}, **shard)
        if checkpointing:
            apply_activation_checkpointing(model, {Block})
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-5)
        data = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            for micro in range(accumulate):
                tokens = torch.randint(0, LLM_ROOT.vocab_size, (2, LLM_ROOT.block_size + 1), generator=data)
                with no_sync(model) if micro < accumulate - 1 else torch.enable_grad():
                    (model(tokens[:, :-1], tokens[:, 1:]) / accumulate).backward()
            optimizer.step()
            optimizer.zero_grad()
        with summon_full_params(model, writeback=False):
            return {name: param.detach().clone() for name, param in model.named_parameters()}
    finally:
        unit.EARLY_REDUCTION_MIN_BYTES = saved


def _bit_equal_runs(rank: int, world_size: int, cases: list[tuple[str, dict, dict]]) -> None:
    for label, shard, extra in cases:
        os.environ[shm.ENV_SWITCH] = "0" if extra.get("gloo_only") else "1"
        options = {k: v for k, v in extra.items() if k != "gloo_only"}
        early, late = (_train(world_size, rank, shard, e, **options) for e in (True, False))
        for name, value in late.items():
            assert torch.equal(early[name], value), f"[{label}] {name} differs with the early reduction"


def _cases(world_size: int) -> list[tuple[str, dict, dict]]:
    cases = [
        ("FULL_SHARD", {}, {}),
        ("SHARD_GRAD_OP", {"sharding_strategy": "SHARD_GRAD_OP"}, {}),
        ("bf16 mixed precision", {"mixed_precision": BF16}, {}),
        ("bf16 NO_SHARD", {"sharding_strategy": "NO_SHARD", "mixed_precision": BF16}, {}),
        ("cpu offload", {"cpu_offload": True}, {}),
        ("no_sync accumulation", {}, {"accumulate": 2}),
        ("frozen embedding", {}, {"freeze": "wte"}),
        ("frozen head", {}, {"freeze": "lm_head"}),
        ("activation checkpointing", {}, {"checkpointing": True}),
        ("gloo only", {"backward_prefetch": "BACKWARD_POST"}, {"gloo_only": True}),
    ]
    if world_size == 4:
        cases += [("HYBRID", HYBRID, {}), ("HYBRID gloo only", HYBRID, {"gloo_only": True})]
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_early_reduction_changes_no_bit_of_training(world_size: int) -> None:
    run_distributed(_bit_equal_runs, world_size, _cases(world_size), timeout=600)


def _parity_and_effect(rank: int, world_size: int) -> None:
    for run in (
        Run(config=LLM_ROOT, steps=3),
        Run(config=LLM_ROOT, steps=3, accumulate=2, skip_sync=True, clip_norm=0.05),
        Run(config=LLM_ROOT, steps=3, freeze=("wte",)),
        Run(config=LLM_ROOT, steps=3, shared_memory=False),
        Run(config=TIED_ROOT, steps=3),
    ):
        run_parity(rank, world_size, run)
    os.environ[shm.ENV_SWITCH] = "1"
    _check_head_freed_during_blocks_backward(LLM_ROOT, early=True)
    _check_head_freed_during_blocks_backward(TIED_ROOT, early=False)


def _check_head_freed_during_blocks_backward(config: GPTConfig, early: bool) -> None:
    """While the first block's backward runs, the untied head's full weight is gone and its gradient reduced (one
    extra reduction); a head tied to the embedding gets its gradient only at the end, so nothing changes."""
    torch.manual_seed(0)
    model = fully_shard(GPT(config), {Block})
    root = unit_of(model)
    head = next(p for p in root.params if any(m is model.lm_head for m, _ in p.owners))
    seen: list[tuple[bool, tuple[int, ...]]] = []

    def in_block_backward(module: nn.Module, grad_output: tuple) -> None:
        seen.append((head.is_unsharded_allocated, tuple(model.lm_head.weight.shape)))

    model.blocks[0].register_full_backward_pre_hook(in_block_backward)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size + 1))
    with CollectiveCounter() as counter:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    reductions = counter.counts[reduce_scatter_kind()]
    units = 1 + config.n_layer
    if early:
        assert seen == [(False, tuple(head.sharded.shape))], f"head during the blocks' backward: {seen}"
        assert reductions == units + 1, f"{reductions} reductions for {units} units: the head's not early"
    else:
        assert seen == [(True, (config.vocab_size, config.n_embd))], f"tied head during backward: {seen}"
        assert reductions == units, f"{reductions} reductions for {units} units"
    assert all(p.grad is not None for p in model.parameters()), "every gradient reduced by the end of backward"


def test_parity_with_unsharded_and_head_freed_early() -> None:
    run_distributed(_parity_and_effect, 2, timeout=600)
