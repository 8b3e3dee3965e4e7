"""The engine's central claim: training sharded equals training unsharded, for every strategy and option."""

from __future__ import annotations

import itertools

import pytest

from tests.distributed import run_distributed
from tests.engine_harness import Run, run_parity

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def _option_matrix() -> list[Run]:
    runs = [
        Run(shard={"sharding_strategy": s, "backward_prefetch": p, "limit_all_gathers": limit})
        for s, p, limit in itertools.product(STRATEGIES, ("BACKWARD_PRE", "BACKWARD_POST", None), (True, False))
    ]
    runs += [Run(shard={"sharding_strategy": s, "forward_prefetch": True}, steps=4) for s in STRATEGIES]
    return runs


def _accumulation_and_clipping() -> list[Run]:
    runs = []
    for strategy in STRATEGIES:
        shard = {"sharding_strategy": strategy}
        runs += [
            Run(shard=shard, steps=3, accumulate=2),
            Run(shard=shard, steps=3, accumulate=2, skip_sync=True),
            Run(shard=shard, clip_norm=0.05),
            Run(shard=shard, clip_norm=0.01, norm_type=float("inf")),
            Run(shard=shard, clip_value=1e-3),
            Run(shard=shard, param_groups=True),
        ]
    return runs


def _run_all(rank: int, world_size: int, runs: list[Run]) -> None:
    for run in runs:
        run_parity(rank, world_size, run)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_every_strategy_and_prefetch_option(world_size: int) -> None:
    run_distributed(_run_all, world_size, _option_matrix(), timeout=600)


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_gradient_accumulation_clipping_and_param_groups(world_size: int) -> None:
    run_distributed(_run_all, world_size, _accumulation_and_clipping(), timeout=600)


def _gloo_only() -> list[Run]:
    """The collectives' other path: all data over gloo, as between hosts or with shared memory switched off."""
    runs = [Run(shard={"sharding_strategy": s}, shared_memory=False) for s in STRATEGIES]
    runs += [
        Run(shard={"backward_prefetch": "BACKWARD_POST", "forward_prefetch": True}, steps=4, shared_memory=False),
        Run(steps=3, accumulate=2, skip_sync=True, clip_norm=0.05, shared_memory=False),
    ]
    return runs


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_over_gloo_without_shared_memory(world_size: int) -> None:
    run_distributed(_run_all, world_size, _gloo_only(), timeout=600)
