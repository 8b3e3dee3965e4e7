"""Parity harness for the engine: the same model, data and seed trained sharded on W ranks and unsharded in one.

Runs inside a rank of ``tests.distributed.run_distributed``. Every rank also trains the unsharded reference on the
global batch (the concatenation of all ranks' local batches), so the comparison needs no extra process.

[Note: parity tolerance] Sharding changes the order of floating-point sums in the gradient reduction, and Adam
divides each gradient element by the root of its running square: an element whose true gradient is near zero turns
that fp32 rounding noise into a visible step. With lr=1e-3 and eps=1e-5 an unsharded all-reduce (NO_SHARD, i.e.
DDP) lands within 7e-6 of the one-process reference after five steps of the model below, so 1e-5 relative to each
tensor's scale separates reduction-order noise from a real error (a wrong shard, a missing or doubled gradient,
which show up at 1e-3 and above).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_fsdp import (
    apply_activation_checkpointing,
    clip_grad_norm_,
    clip_grad_value_,
    fully_shard,
    no_sync,
    summon_full_params,
)
from lightning_fsdp.demos.gpt import GPT, Block, GPTConfig
from lightning_fsdp.engine.transport import shm

RTOL = 1e-5
# Biases start at zero and move about lr per step, so their own scale is ~1e-3 after a few steps; an absolute
# floor of 1e-4 x lr keeps reduction-order noise there from reading as a relative error.
ATOL = 1e-7
# Dims chosen to stress the layout: 61 rows and 18-wide rows divide by neither 2 nor 4.
TINY_GPT = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, n_embd=18, bias=True)


@dataclass
class Run:
    """One parity case: how to shard and how to train."""

    shard: dict[str, Any] = field(default_factory=dict)
    steps: int = 5
    accumulate: int = 1
    skip_sync: bool = False  # use no_sync on all but the last micro-batch
    clip_norm: float | None = None
    norm_type: float = 2.0
    clip_value: float | None = None
    param_groups: bool = False
    freeze: tuple[str, ...] = ()  # name prefixes of parameters trained frozen (requires_grad=False)
    checkpointing: bool = False  # activation checkpointing of every Block
    local_batch: int = 2
    config: GPTConfig = TINY_GPT
    shared_memory: bool = True  # collectives' data through shared memory (the default between ranks of one host)

    def label(self) -> str:
        extras = [f"{k}={v}" for k, v in self.shard.items() if k != "policy"]
        if self.accumulate > 1:
            extras.append(f"accumulate={self.accumulate}{' no_sync' if self.skip_sync else ''}")
        if self.clip_norm is not None:
            extras.append(f"clip={self.clip_norm} p={self.norm_type}")
        if self.clip_value is not None:
            extras.append(f"clip_value={self.clip_value}")
        if self.param_groups:
            extras.append("two param groups")
        if self.freeze:
            extras.append(f"frozen {self.freeze}")
        if self.checkpointing:
            extras.append("activation checkpointing")
        if not self.shared_memory:
            extras.append("gloo only")
        return ", ".join(extras) or "defaults"


def reduce_scatter_kind() -> str:
    """How a reduce-scatter between gloo ranks of one host is counted: through shared memory (the default, see
    ``lightning_fsdp/engine/transport/shm/``) it is one; with that switched off it is an all-to-all plus a local
    sum."""
    return "reduce_scatter" if shm.enabled() else "all_to_all"


def data_moving(counts: Counter[str]) -> dict[str, int]:
    """Counts or bytes by kind, without the barriers that tell shared-memory readers the data is there."""
    return {kind: value for kind, value in counts.items() if kind != "barrier"}


def initialize(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One forward without gradients: the root's lazy initialization (a collective) before anything is counted."""
    with torch.no_grad():
        model(inputs, targets)


def make_optimizer(model: nn.Module, param_groups: bool) -> torch.optim.Optimizer:
    if not param_groups:
        return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or ".ln_" in name or name.startswith("ln_") else decay).append(param)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, eps=1e-5)


def train_tokens(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """``steps`` optimizer steps of the tiny GPT on random tokens from ``seed`` (2 sequences a step): the training
    the checkpoint tests save, resume and compare."""
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size + 1), generator=data)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference relative to the tensor's scale, with the ATOL floor folded in (passes below RTOL)."""
    scale = expected.abs().max() + ATOL / RTOL
    return ((actual - expected).abs().max() / scale).item()


def run_parity(rank: int, world_size: int, run: Run) -> None:
    """Train sharded and unsharded side by side and assert weights (and clipped norms) agree."""
    os.environ[shm.ENV_SWITCH] = "1" if run.shared_memory else "0"  # read at the root's first forward
    torch.manual_seed(0)
    reference = GPT(run.config)
    for name, param in reference.named_parameters():
        param.requires_grad_(not name.startswith(run.freeze) if run.freeze else True)
    frozen_before = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    model = copy.deepcopy(reference)
    fully_shard(model, **{"policy": {Block}, **run.shard})
    if run.checkpointing:
        apply_activation_checkpointing(model, {Block})
    optimizer = make_optimizer(model, run.param_groups)
    ref_optimizer = make_optimizer(reference, run.param_groups)
    data = torch.Generator().manual_seed(1)
    global_batch = run.local_batch * world_size
    for step in range(run.steps):
        for micro in range(run.accumulate):
            tokens = torch.randint(0, run.config.vocab_size, (global_batch, run.config.block_size + 1), generator=data)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            local = slice(rank * run.local_batch, (rank + 1) * run.local_batch)
            skip = run.skip_sync and micro < run.accumulate - 1
            with no_sync(model) if skip else nullcontext():
                (model(inputs[local], targets[local]) / run.accumulate).backward()
            (reference(inputs, targets) / run.accumulate).backward()
        if run.clip_norm is not None:
            norm = clip_grad_norm_(model.parameters(), run.clip_norm, run.norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), run.clip_norm, run.norm_type)
            error = abs(norm.item() - ref_norm.item()) / ref_norm.item()
            assert error < RTOL, f"[{run.label()}] step {step}: total norm {norm.item()} != {ref_norm.item()}"
        if run.clip_value is not None:
            clip_grad_value_(model.parameters(), run.clip_value)
            torch.nn.utils.clip_grad_value_(reference.parameters(), run.clip_value)
        optimizer.step()
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    assert_same_weights(model, reference, run.label())
    with summon_full_params(model, writeback=False):
        for name, param in model.named_parameters():
            if name in frozen_before:
                assert torch.equal(param, frozen_before[name]), f"[{run.label()}] frozen {name} changed"
                assert param.grad is None, f"[{run.label()}] frozen {name} has a gradient"


def assert_same_weights(model: nn.Module, reference: nn.Module, label: str) -> None:
    with summon_full_params(model, writeback=False):
        for (name, param), ref_param in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert param.shape == ref_param.shape, f"[{label}] {name}: shape {param.shape} != {ref_param.shape}"
            error = max_relative_error(param.detach(), ref_param.detach())
            assert error < RTOL, f"[{label}] {name}: relative error {error:.2e} after training"
