"""What the CUDA tests share: when they run, how many ranks they get, and the sharded-against-unsharded comparison.

Every test here is marked ``cuda`` and skipped only when torch sees no CUDA device (on CPU machines they cost a
skip at collection, nothing more); ``scripts/gpu_check.sh`` runs them all. Each rank of ``run_distributed(...,
backend="nccl")`` owns CUDA device ``rank`` and trains the sharded model beside the unsharded reference on the same
device, as ``tests/engine_harness.py`` does on the CPU, so one spawn needs no second process for the reference.
The tests use the engine's public API only, so they exercise whichever transport it picks under NCCL.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fsdp import clip_grad_norm_, fully_shard, summon_full_params
from lightning_fsdp.demos.gpt import GPT, Block
from tests.engine_harness import RTOL, TINY_GPT, make_optimizer, max_relative_error

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

#: Every CUDA test carries both marks: ``-m cuda`` selects them, and without a device they are skipped.
cuda = [pytest.mark.cuda, pytest.mark.skipif(GPUS == 0, reason="no CUDA device")]
#: For the world size 2 variants: NCCL refuses two ranks on one device.
two_gpus = pytest.mark.skipif(GPUS < 2, reason="W=2 under NCCL needs 2 CUDA devices (one per rank)")

#: The world sizes a test on every available device count runs: 1 always, 2 when there are two devices.
WORLD_SIZES = [1, pytest.param(2, marks=two_gpus)]

LOCAL_BATCH = 2


def exact_fp32() -> None:
    """fp32 matmuls in fp32: TF32 (on by default for cuDNN, and in some builds for matmuls) rounds inputs to 10
    bits and would swamp the 1e-5 parity of ``tests/engine_harness.py``'s [Note: parity tolerance]."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def rank_device() -> torch.device:
    """This rank's CUDA device (``run_distributed`` made it the current one)."""
    return torch.device("cuda", torch.cuda.current_device())


def global_batch(step: int, world_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (every rank builds the same one), inputs and next-token targets."""
    data = torch.Generator().manual_seed(step)
    shape = (LOCAL_BATCH * world_size, TINY_GPT.block_size + 1)
    tokens = torch.randint(0, TINY_GPT.vocab_size, shape, generator=data).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def local_part(rank: int) -> slice:
    return slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def assert_same_weights(model: nn.Module, reference: nn.Module, label: str, tolerance: float = RTOL) -> None:
    """Gather the sharded model whole and compare every parameter with the reference's (on the reference's device)."""
    expected = dict(reference.named_parameters())
    with summon_full_params(model, writeback=False):
        names = [name for name, _ in model.named_parameters()]
        assert names == list(expected), f"[{label}] parameter names changed: {names} vs {list(expected)}"
        for name, param in model.named_parameters():
            actual = param.detach().to(expected[name].device, torch.float32)
            error = max_relative_error(actual, expected[name].detach().float())
            assert error < tolerance, f"[{label}] {name}: relative error {error:.2e} >= {tolerance:g}"


def train_side_by_side(
    rank: int,
    world_size: int,
    shard: Callable[[nn.Module], nn.Module],
    label: str,
    steps: int = 4,
    clip_norm: float | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Train ``shard(copy of the reference)`` on this rank's part of each batch and the reference on all of it,
    AdamW on both, and assert the clipped norms and then the weights agree; returns (sharded, reference)."""
    device = rank_device()
    torch.manual_seed(0)
    reference = GPT(TINY_GPT).to(device)
    model = shard(copy.deepcopy(reference))
    optimizer, ref_optimizer = make_optimizer(model, False), make_optimizer(reference, False)
    for step in range(steps):
        inputs, targets = global_batch(step, world_size, device)
        loss = model(inputs[local_part(rank)], targets[local_part(rank)])
        loss.backward()
        reference(inputs, targets).backward()
        assert torch.isfinite(loss).item(), f"[{label}] step {step}: loss {loss.item()}"
        if clip_norm is not None:
            norm = clip_grad_norm_(model.parameters(), clip_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm)
            error = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            assert error < RTOL, f"[{label}] step {step}: total norm {norm.item()} != {ref_norm.item()}"
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert_same_weights(model, reference, label)
    return model, reference


def shard_with(**options: Any) -> Callable[[nn.Module], nn.Module]:
    """``fully_shard(module, {Block}, **options)`` as a one-argument function."""
    return lambda module: fully_shard(module, {Block}, **options)
