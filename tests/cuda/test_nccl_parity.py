"""Under NCCL, on CUDA devices, the sharded model trains like the unsharded one: every sharding strategy, prefetching
on and off, gradient clipping, after several AdamW steps, to the same 1e-5 as the CPU parity tests."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.cuda_harness import WORLD_SIZES, cuda, exact_fp32, shard_with, train_side_by_side
from tests.distributed import run_distributed

pytestmark = cuda

CASES: list[tuple[str, dict]] = [
    ("FULL_SHARD", {}),
    ("FULL_SHARD, forward prefetch", {"forward_prefetch": True}),
    ("FULL_SHARD, no backward prefetch", {"backward_prefetch": None}),
    ("SHARD_GRAD_OP", {"sharding_strategy": "SHARD_GRAD_OP"}),
    ("NO_SHARD", {"sharding_strategy": "NO_SHARD"}),
]


def _every_case(rank: int, world_size: int) -> None:
    exact_fp32()
    for label, options in CASES:
        model, _ = train_side_by_side(rank, world_size, shard_with(**options), f"W={world_size} {label}", clip_norm=0.5)
        device = torch.device("cuda", rank)
        for name, param in model.named_parameters():  # the shards stay on this rank's device
            assert param.device == device, f"[{label}] {name} is on {param.device}, not {device}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_nccl_parity_with_the_unsharded_model(world_size: int) -> None:
    run_distributed(_every_case, world_size, backend="nccl", timeout=150.0)
