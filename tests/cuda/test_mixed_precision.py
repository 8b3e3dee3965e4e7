"""bf16 mixed precision on CUDA: the forward and backward compute with bf16 parameters gathered from fp32 shards,
gradients reach the optimizer in fp32, and the weights follow a reference that does the same casts by hand."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_fsdp import MixedPrecision
from lightning_fsdp.demos.gpt import GPT
from tests.cuda import cuda_harness
from tests.cuda.cuda_harness import (
    WORLD_SIZES,
    assert_same_weights,
    cuda,
    global_batch,
    local_part,
    shard_with,
)
from tests.distributed import run_distributed
from tests.engine_harness import TINY_GPT

pytestmark = cuda

# As in tests/test_engine_mixed_precision.py: both sides round at bf16's 8 bits, in different places (W local
# backward passes against one global one), so after a few SGD steps the weights agree to a fraction of a percent.
TOLERANCE = 2e-2


def _reference_step(master: nn.Module, low: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """What mixed precision means, written out: compute in the bf16 copy, step the fp32 master."""
    with torch.no_grad():
        for low_param, param in zip(low.parameters(), master.parameters(), strict=True):
            low_param.copy_(param)
    low(inputs, targets).backward()
    for low_param, param in zip(low.parameters(), master.parameters(), strict=True):
        param.grad = low_param.grad.float()
        low_param.grad = None


def _bf16_parity(rank: int, world_size: int) -> None:
    device = cuda_harness.rank_device()
    torch.manual_seed(0)
    master = GPT(TINY_GPT).to(device)
    low = copy.deepcopy(master).to(torch.bfloat16)
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_with(mixed_precision=policy)(copy.deepcopy(master))
    compute_dtypes: set[torch.dtype] = set()
    model.blocks[0].mlp.fc.register_forward_pre_hook(lambda module, _: compute_dtypes.add(module.weight.dtype))
    optimizer, ref_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, master))
    for step in range(3):
        inputs, targets = global_batch(step, world_size, device)
        loss = model(inputs[local_part(rank)], targets[local_part(rank)])
        loss.backward()
        _reference_step(master, low, inputs, targets)
        assert torch.isfinite(loss).item(), f"step {step}: loss {loss.item()}"
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32, f"the shard {name} must stay fp32 (the master weights)"
            assert param.grad is not None and param.grad.dtype == torch.float32, f"{name}'s gradient must be fp32"
            assert param.grad.device == device, f"{name}'s gradient is on {param.grad.device}"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert compute_dtypes == {torch.bfloat16}, f"the forward computed with {compute_dtypes}, not bf16 alone"
    assert_same_weights(model, master, f"W={world_size} bf16", tolerance=TOLERANCE)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_mixed_precision_matches_the_casts_done_by_hand(world_size: int) -> None:
    run_distributed(_bf16_parity, world_size, backend="nccl", timeout=150.0)
