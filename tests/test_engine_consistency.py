"""Ranks that disagree fail by name within seconds, on shared memory and over gloo alone; refusals change nothing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp import fully_shard
from lightning_fsdp.demos.gpt import GPT, Block
from lightning_fsdp.engine import shm
from lightning_fsdp.engine.fingerprint import ModelMismatchError
from lightning_fsdp.engine.ledger import CollectiveMismatchError
from lightning_fsdp.engine.registry import unit_of
from tests.engine_harness import TINY_GPT

SECONDS = 10.0  # "at once": far below the process group's timeout


class Branchy(nn.Module):
    """One unit (``extra``) runs on rank 1 only: every rank builds the same model, but rank 1 takes a branch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.extra = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.inp(x))
        if dist.get_rank() == 1:
            x = self.extra(x)
        return self.blocks[1](x).sum()


def _gpt_step(rank: int, seed: int, **config: int) -> None:
    torch.manual_seed(seed)
    model = fully_shard(GPT(replace(TINY_GPT, **config)), {Block})
    tokens = torch.randint(0, 61, (2, TINY_GPT.block_size + 1), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()


def _branchy_step(rank: int) -> None:
    torch.manual_seed(0)
    model = fully_shard(Branchy(), {nn.Sequential})
    model(torch.ones(2, 8)).backward()


# (what goes wrong, what every rank runs, the error, what its message must say)
MISMATCHES: list[tuple[str, Callable[[int], None], type[Exception], str]] = [
    (
        "shapes",
        lambda rank: _gpt_step(rank, 0, vocab_size=61 + rank),
        ModelMismatchError,
        r"parameter 'wte.weight' of unit '<root>' has shape \(61, 18\) on rank 0 but \(62, 18\) on rank 1; build the "
        r"same model",
    ),
    (
        "unit count",
        lambda rank: _gpt_step(rank, 0, n_layer=3 + rank),
        ModelMismatchError,
        r"rank 0 has 4 sharding units but rank 1 has 5 \(the first unit only one of them has is 'blocks.3' \(Block\)\)",
    ),
    (
        "seeds",
        lambda rank: _gpt_step(rank, rank),
        ModelMismatchError,
        r"rank 1 built the model with other initial values than rank 0 \(first difference: parameter 'wte.weight' of "
        r"unit '<root>'\).*seed every rank alike.*sync_module_states=True",
    ),
    (
        "unit on one rank",
        _branchy_step,
        CollectiveMismatchError,
        r"ranks entered different collectives: rank \d is in the all-gather #3 of unit '(blocks.1|extra)' "
        r"\(\d+ bytes\) but rank \d is in the all-gather #3 of unit '(extra|blocks.1)'",
    ),
]


def _check_mismatches_are_named(rank: int, world_size: int) -> None:
    for transport in ("1", "0"):
        os.environ[shm.ENV_SWITCH] = transport  # read at the root's first forward
        for label, run, error, message in MISMATCHES:
            start = time.monotonic()
            with pytest.raises(error, match=message):
                run(rank)
            elapsed = time.monotonic() - start
            assert elapsed < SECONDS, f"[{label}, shared memory {transport}] named after {elapsed:.1f} s"
            dist.barrier()  # every rank raised; the group is still in step for the next case
        # Different seeds are fine when rank 0's values are broadcast before sharding.
        torch.manual_seed(rank)
        model = fully_shard(GPT(TINY_GPT), {Block}, sync_module_states=True)
        tokens = torch.randint(0, 61, (2, TINY_GPT.block_size + 1), generator=torch.Generator().manual_seed(1))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        # A checkpoint loaded into the sharded model overrides the values each rank built: no mismatch then.
        torch.manual_seed(rank)
        loaded = fully_shard(GPT(TINY_GPT), {Block})
        with torch.no_grad():
            for (_, param), (_, source) in zip(loaded.named_parameters(), model.named_parameters(), strict=True):
                param.copy_(source)
        loaded(tokens[:, :-1], tokens[:, 1:]).backward()


def _check_refusals_change_nothing(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    model.wpe.weight = nn.Parameter(model.wpe.weight.detach().double())  # the root unit mixes dtypes
    before = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match=r"the unit GPT holds parameters of different dtypes.*'wpe.weight'"):
        fully_shard(model, {Block})
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, value) in before.items():
        assert after[name] is param, f"{name} was replaced by a refused fully_shard"
        assert torch.equal(param, value), f"{name} changed"
    for module in model.modules():
        assert unit_of(module) is None, f"{type(module).__name__} became a unit"
        assert not module._forward_pre_hooks and not module._forward_hooks, f"{type(module).__name__} got hooks"

    # An optimizer built before sharding holds tensors the model no longer uses: its first step says so.
    torch.manual_seed(0)
    model = GPT(TINY_GPT)
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model, {Block})
    tokens = torch.randint(0, 61, (2, TINY_GPT.block_size + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    with pytest.raises(RuntimeError, match=r"SGD holds the parameter 'wte.weight' as it was before fully_shard"):
        stale.step()
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = next(model.parameters()).detach().clone()
    fresh.step()
    assert not torch.equal(next(model.parameters()), shard), "built after fully_shard, the optimizer steps the shards"


def test_ranks_that_disagree_fail_by_name_on_both_transports() -> None:
    from tests.distributed import run_distributed

    run_distributed(_check_mismatches_are_named, 2)


def test_a_refused_fully_shard_and_a_stale_optimizer_change_nothing() -> None:
    from tests.distributed import run_distributed

    run_distributed(_check_refusals_change_nothing, 2)
