"""Memory, asserted: shards only between steps, and a bounded number of gathered units during a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.runtime.registry import units_under
from tests.distributed import run_distributed

DEEP_GPT = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel() > 0}
    return sum(storages.values())


def _gathered_units(model: nn.Module) -> int:
    return sum(any(p.is_unsharded_allocated for p in unit.params) for unit in units_under(model))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, DEEP_GPT.vocab_size, (2, DEEP_GPT.block_size + 1), generator=data)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep the gradients alive: they are part of what we measure


def _check_shards_only_after_step(rank: int, world_size: int) -> None:
    full_bytes = sum(p.numel() for p in GPT(DEEP_GPT).parameters()) * 4
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        torch.manual_seed(0)
        model = fully_shard(GPT(DEEP_GPT), {Block}, sharding_strategy=strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):
            _train_step(model, optimizer, step)
        assert _gathered_units(model) == 0, f"[{strategy}] units still gathered after optimizer.step()"
        params = list(model.parameters())
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        param_bytes = _storage_bytes(params)
        grad_bytes = _storage_bytes([p.grad for p in params])
        state_bytes = _storage_bytes([t for t in state if t.dim() > 0])  # exp_avg, exp_avg_sq; not the step counts
        # What 1/W of the model costs on this rank, padding rows included (every rank stores ceil(rows/W) rows).
        shard_bytes = sum(p.layout.shard_numel for unit in units_under(model) for p in unit.params) * 4
        assert shard_bytes <= 1.05 * full_bytes / world_size, f"padding: {shard_bytes} B for 1/{world_size} of it"
        for what, measured, bound in (
            ("parameters", param_bytes, shard_bytes),
            ("gradients", grad_bytes, shard_bytes),
            ("optimizer state", state_bytes, 2 * shard_bytes),
        ):
            assert measured <= bound, f"[{strategy}] {what}: {measured} B alive > {bound} B (1/W of the model)"
        total = param_bytes + grad_bytes + state_bytes
        assert total <= 4 * full_bytes * (1 / world_size + 0.05), f"[{strategy}] {total} B is not about 1/W of 4x"


def _sample_gathered_units(model: nn.Module) -> list[int]:
    """Record how many units are gathered each time a leaf module runs forward or backward."""
    peaks: list[int] = []

    def sample(*_: object) -> None:
        peaks.append(_gathered_units(model))

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.LayerNorm | nn.Embedding):
            module.register_forward_pre_hook(sample)
            module.register_full_backward_pre_hook(sample)
    return peaks


def _check_gathered_units_bounded(rank: int, world_size: int) -> None:
    # (backward_prefetch, forward_prefetch) -> most units gathered at once: the root (kept through backward),
    # the unit in use, and at most one prefetched unit.
    cases = {(None, False): 2, ("BACKWARD_PRE", False): 3, ("BACKWARD_POST", False): 3, ("BACKWARD_PRE", True): 3}
    for (backward_prefetch, forward_prefetch), bound in cases.items():
        torch.manual_seed(0)
        model = fully_shard(
            GPT(DEEP_GPT), {Block}, backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch
        )
        peaks = _sample_gathered_units(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            _train_step(model, optimizer, step)
        label = f"backward_prefetch={backward_prefetch}, forward_prefetch={forward_prefetch}"
        assert max(peaks) <= bound, f"[{label}] {max(peaks)} of {DEEP_GPT.n_layer + 1} units gathered at once"
        assert max(peaks) >= 2, f"[{label}] sampling saw no gathered block; the check measured nothing"


@pytest.mark.parametrize("world_size", [2, 4])
def test_only_shards_stay_alive_after_optimizer_step(world_size: int) -> None:
    run_distributed(_check_shards_only_after_step, world_size)


def test_gathered_units_bounded_during_forward_and_backward() -> None:
    run_distributed(_check_gathered_units_bounded, 2)
