"""CPU offload on CUDA: the shards and their gradients live in pinned CPU memory (the optimizer steps there), each
unit computes on the GPU with parameters copied up for it, and training matches the unsharded model on the GPU."""

from __future__ import annotations

import pytest
import torch

from tests.cuda.cuda_harness import (
    WORLD_SIZES,
    cuda,
    exact_fp32,
    global_batch,
    local_part,
    shard_with,
    train_side_by_side,
)
from tests.distributed import run_distributed

pytestmark = cuda


def _offload(rank: int, world_size: int) -> None:
    exact_fp32()
    compute_devices: set[torch.device] = set()

    def shard(module: torch.nn.Module) -> torch.nn.Module:
        module = shard_with(cpu_offload=True)(module)
        module.blocks[0].mlp.fc.register_forward_pre_hook(lambda m, _: compute_devices.add(m.weight.device))
        return module

    model, _ = train_side_by_side(rank, world_size, shard, f"W={world_size} cpu_offload", clip_norm=0.5)
    assert compute_devices == {torch.device("cuda", rank)}, f"units computed on {compute_devices}"
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", f"the shard {name} is on {param.device}, not offloaded"
        # Pinned, so that the copy to the GPU for each unshard can run asynchronously.
        assert param.is_pinned(), f"the offloaded shard {name} is not in pinned memory"
    # The gradients of the last step were zeroed (set to None); one more backward puts them on the CPU, pinned.
    inputs, targets = global_batch(99, world_size, torch.device("cuda", rank))
    model(inputs[local_part(rank)], targets[local_part(rank)]).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.device.type == "cpu", f"{name}'s gradient is not on the CPU"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cpu_offload_keeps_pinned_shards_on_the_cpu_and_trains_like_the_unsharded_model(world_size: int) -> None:
    run_distributed(_offload, world_size, backend="nccl", timeout=150.0)
