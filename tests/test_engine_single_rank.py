"""World size 1: the parameters stay whole, nothing is gathered or copied, and every API answers as at any size.

See [Note: one rank keeps the parameter whole] in lightning_fsdp/engine/param.py. Runs in the test process on a real
one-rank gloo group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_fsdp import MixedPrecision, clip_grad_norm_, fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.state.state_dict import full_state_dict, sharded_state_dict
from tests.engine_harness import TINY_GPT


@pytest.fixture(autouse=True)
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=generator)] * steps


def test_one_rank_trains_as_the_plain_module_with_its_own_parameters() -> None:
    torch.manual_seed(0)
    reference = GPT(TINY_GPT)
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    originals = dict(model.named_parameters())
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before fully_shard: at W=1 it still works
    fully_shard(model, {Block})
    assert all(p is originals[name] for name, p in model.named_parameters()), "the registered tensors stay"
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step, tokens in enumerate(_batches(3)):
        for net, optimizer in ((model, early), (reference, reference_optimizer)):
            optimizer.zero_grad(set_to_none=True)
            net(tokens[:, :-1], tokens[:, 1:]).backward()
        assert all(unit.is_whole for unit in units_under(model))
        assert all(p.grad is not None for p in model.parameters()), "gradients stay where autograd put them"
        norm = clip_grad_norm_(model.parameters(), max_norm=0.5)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5))
        early.step()
        reference_optimizer.step()
        for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(param, expected), f"step {step}: {name}"
    assert all(p is originals[name] for name, p in model.named_parameters()), "between steps too"

    full = full_state_dict(model)
    assert full.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name], value), name
    sharded = sharded_state_dict(model)
    for name, param in model.named_parameters():
        assert torch.equal(sharded[name], param), name  # the whole tensor, as before this path existed
    with summon_full_params(model, writeback=True), torch.no_grad():
        model.wte.weight.add_(1.0)
    assert torch.equal(model.wte.weight, reference.wte.weight + 1.0), "summon's writeback reaches the parameter"


def test_one_rank_under_mixed_precision_still_casts() -> None:
    """A parameter whose compute dtype differs is not whole: its bf16 copy is made (a cast, not a gather)."""
    torch.manual_seed(0)
    model = fully_shard(GPT(TINY_GPT), {Block}, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    assert not any(unit.is_whole for unit in units_under(model))
    tokens = _batches(1)[0]
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
