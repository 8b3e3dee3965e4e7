"""Ranks that disagree fail by name within seconds, on shared memory and over gloo alone; refusals change nothing;
ranks that built the same model with other values (unseeded) all take rank 0's, as DDP does."""

from __future__ import annotations

import logging
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
from lightning_fsdp.engine.build.fingerprint import ModelMismatchError
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.state.state_dict import full_state_dict
from lightning_fsdp.engine.transport import shm
from lightning_fsdp.engine.transport.identity import CollectiveMismatchError
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


class WithBuffers(nn.Module):
    """Parameters in two units, a BatchNorm's running stats, and a non-persistent buffer drawn at init."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)
        self.register_buffer("scale", torch.rand(16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.block(self.inp(x)) * self.scale)).pow(2).mean()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = full_state_dict(model, rank0_only=False)
    return {**state, "scale": model.scale.detach().clone()} if isinstance(model, WithBuffers) else state


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert actual.keys() == expected.keys(), label
    for name, value in expected.items():
        assert torch.equal(actual[name].cpu(), value), f"[{label}] {name} is not rank 0's"


def _check_other_seeds_take_rank0s_values(rank: int, world_size: int) -> None:
    records = _Records()
    logger = logging.getLogger("lightning_fsdp.engine.api")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))

    torch.manual_seed(0)
    reference = WithBuffers()
    expected = {**reference.state_dict(), "scale": reference.scale.clone()}
    torch.manual_seed(rank)  # rank 0 builds the reference's model, rank 1 another one
    model = fully_shard(WithBuffers(), {nn.Sequential})
    model.eval()
    with torch.no_grad():
        model(x)
    _assert_equal(_full_state(model), expected, "eager, after one forward")
    assert len(records.messages) == (1 if rank == 0 else 0), records.messages
    if rank == 0:
        assert "other initial values" in records.messages[0] and "rank 0's parameters" in records.messages[0]

    # Training then is that of rank 0's model alone (every rank sees the same batch: the mean gradient is its own).
    model.train()
    reference.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad()
        reference(x).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    trained = _full_state(model)
    for name, value in {**reference.state_dict(), "scale": reference.scale}.items():
        torch.testing.assert_close(trained[name].cpu(), value, rtol=1e-5, atol=1e-6, msg=f"{name} after training")

    # Ranks seeded alike: nothing broadcast, nothing logged.
    records.messages.clear()
    torch.manual_seed(0)
    alike = fully_shard(WithBuffers(), {nn.Sequential})
    with torch.no_grad():
        alike(x)
    assert records.messages == []

    # Deferred init: each unit, as it materialises with each rank's own draws, takes rank 0's values.
    torch.manual_seed(0)
    expected = GPT(TINY_GPT).state_dict()
    torch.manual_seed(rank)
    with torch.device("meta"):
        meta = GPT(TINY_GPT)
    meta = fully_shard(meta, {Block})
    tokens = torch.randint(0, 61, (2, TINY_GPT.block_size + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        meta(tokens[:, :-1], tokens[:, 1:])
    _assert_equal(_full_state(meta), expected, "deferred init")
    logger.removeHandler(records)


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


def test_ranks_with_other_values_take_rank_0s_and_train_as_rank_0_alone() -> None:
    from tests.distributed import run_distributed

    run_distributed(_check_other_seeds_take_rank0s_values, 2)


def test_a_refused_fully_shard_and_a_stale_optimizer_change_nothing() -> None:
    from tests.distributed import run_distributed

    run_distributed(_check_refusals_change_nothing, 2)
