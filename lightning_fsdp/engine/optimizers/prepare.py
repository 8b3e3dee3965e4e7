"""Before an optimizer's first step: what it reads of each sharded parameter, and the layout that makes it exact.

[Note: an optimizer is prepared before its first step] A parameter is sharded by rows when ``fully_shard`` runs,
before any optimizer exists. Each optimizer is *prepared* once its parameters are known and before it changes any of
them: at its first ``step()`` (a global step pre-hook, so a plain optimizer over ``fully_shard``ed parameters is
covered), earlier where a framework hands it over (the strategies' setup, so a refusal comes before training), and
before a checkpoint loads state into it (``init_optimizer_state`` steps it). Preparing asks what the optimizer reads
of each parameter spread over ranks (``scope.py``): element-wise updates keep their rows; a parameter it reads whole
moves, with its value and gradient, to live whole on one rank (``FSDPUnit.hold_whole``); an optimizer that reads
across tensors is refused, naming itself, before anything changed. Every rank of a shard group must reach the same
answer, which is checked (a disagreement would misalign the collectives). Preparing again (``add_param_group``)
looks only at what is new; a parameter that already moved stays whole.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.engine.optimizers.owners import plan_owners, work_of
from lightning_fsdp.engine.optimizers.scope import (
    ProbeFailedError,
    UpdateScope,
    declared_scope,
    probe_scope,
    probe_shape,
)
from lightning_fsdp.engine.optimizers.step_hook import HookWhileAlive
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.registry import fsdp_param_of, unit_holding
from lightning_fsdp.engine.runtime.root import contexts_of

_PREPARED: WeakKeyDictionary[Optimizer, int] = WeakKeyDictionary()  # -> the parameters it held when prepared


def install_step_hook(module: nn.Module) -> None:
    """Prepare every optimizer at its first step (see the Note), while ``module`` or another model ``fully_shard``
    sharded lives: the hook goes with the last of them, so that nothing of ours stays in the steps of every optimizer
    of the process (see [Note: a global step hook goes when its objects do, never during a step] in
    ``step_hook.py``)."""
    _STEP_HOOK.watch(module)


def _prepare_before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    prepare_optimizer(optimizer)


_STEP_HOOK = HookWhileAlive(_prepare_before_step)


def prepare_optimizer(optimizer: Optimizer) -> None:
    """Make ``optimizer``'s steps on sharded parameters exact: keep rows for element-wise updates, move parameters it
    reads whole to one rank each, refuse an optimizer that reads across tensors. A collective over the parameters'
    groups: every rank calls it alike (the first ``step()`` does). Safe to call again."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _PREPARED.get(optimizer) == count:
        return
    spread = _spread_params(optimizer)
    if spread:
        scopes = _scopes(optimizer, spread)
        _check_ranks_agree(optimizer, spread, scopes)
        across = [p for (_, p), scope in zip(spread, scopes, strict=True) if scope is UpdateScope.ACROSS_TENSORS]
        if across:
            raise ValueError(_reads_across(optimizer, across[0]))
        whole = [p for (_, p), scope in zip(spread, scopes, strict=True) if scope is UpdateScope.TENSOR]
        if whole:
            _refuse_existing_state(optimizer, whole)
            _hold_whole(whole)
    _PREPARED[optimizer] = count


def _spread_params(optimizer: Optimizer) -> list[tuple[int, FSDPParam]]:
    """(group index, parameter) of every trainable parameter the optimizer steps whose rows lie on several ranks."""
    found, seen = [], set()
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            fsdp_param = fsdp_param_of(param)
            if fsdp_param is None or id(fsdp_param) in seen or not param.requires_grad:
                continue
            seen.add(id(fsdp_param))
            if fsdp_param.layout.spans_ranks:
                found.append((index, fsdp_param))
    return found


def _scopes(optimizer: Optimizer, spread: list[tuple[int, FSDPParam]]) -> list[UpdateScope]:
    declared = declared_scope(optimizer)
    if declared is not None:
        return [declared] * len(spread)
    asked: dict[tuple[Any, ...], UpdateScope] = {}
    scopes = []
    for index, fsdp_param in spread:
        like = fsdp_param.sharded
        shape = probe_shape(fsdp_param.shape)
        key = (index, shape, like.dtype, like.device)
        if key not in asked:
            try:
                asked[key] = probe_scope(optimizer, index, shape, like)
            except ProbeFailedError as error:
                raise ValueError(_probe_failed(optimizer, fsdp_param, error)) from error
        scopes.append(asked[key])
    return scopes


def _check_ranks_agree(optimizer: Optimizer, spread: list[tuple[int, FSDPParam]], scopes: list[UpdateScope]) -> None:
    """Every rank that shares these parameters' collectives must have found the same scopes."""
    order = list(UpdateScope)
    code = torch.tensor([order.index(scope) for scope in scopes], dtype=torch.int64)
    groups = {id(g): g for _, p in spread for g in (p.group, p.replicate_group) if g is not None and g.size() > 1}
    for group in groups.values():
        low, high = code.clone(), code.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise RuntimeError(
                f"the ranks found different answers to what {type(optimizer).__name__} reads of its parameters (its "
                "probe is not deterministic here); declare it with lightning_fsdp.declare_update_scope("
                f"{type(optimizer).__name__}, 'tensor') or 'elementwise'."
            )


def _refuse_existing_state(optimizer: Optimizer, moving: list[FSDPParam]) -> None:
    for fsdp_param in moving:
        if optimizer.state.get(fsdp_param.sharded):
            raise ValueError(
                f"{type(optimizer).__name__} already holds state for '{fsdp_param.fqn}' as this rank's rows, but its "
                "step reads the whole tensor, which must first move to one rank; load optimizer state only through "
                "lightning_fsdp's checkpoint functions (or after the first step), which prepare the optimizer first."
            )


def _hold_whole(moving: list[FSDPParam]) -> None:
    """Move ``moving`` to live whole, unit by unit in a fixed order, owners planned (``owners.py``)."""
    by_unit: dict[int, list[FSDPParam]] = {}
    units = {}
    for fsdp_param in moving:
        unit = unit_holding(fsdp_param)
        units[id(unit)] = unit
        by_unit.setdefault(id(unit), []).append(fsdp_param)
    work: dict[int, list[int]] = {}  # per shard group size: each rank's work on what it holds whole
    for unit in units.values():
        ranks = work.setdefault(unit.world_size, [0] * unit.world_size)
        for whole in unit.wholes:
            for fsdp_param, owner in zip(whole.params, whole.owners, strict=True):
                ranks[owner] += work_of(fsdp_param.shape)
    for unit_id, params in by_unit.items():
        unit = units[unit_id]
        unit.hold_whole(params, plan_owners([p.shape for p in params], work[unit.world_size]))
    for context in contexts_of(units[unit_id] for unit_id in by_unit):
        context.relaid()


def _reads_across(optimizer: Optimizer, fsdp_param: FSDPParam) -> str:
    name = type(optimizer).__name__
    return (
        f"{name} cannot train sharded parameters exactly: its update of one parameter ('{fsdp_param.fqn}') reads "
        "other parameters too (statistics over several tensors), which no rank holds together; train with "
        "sharding_strategy='NO_SHARD' (or strategy='ddp'), or, if its step does read each tensor on its own, say so "
        f"with lightning_fsdp.declare_update_scope({name}, 'tensor')."
    )


def _probe_failed(optimizer: Optimizer, fsdp_param: FSDPParam, error: ProbeFailedError) -> str:
    name = type(optimizer).__name__
    return (
        f"lightning_fsdp could not tell what {name} reads to update '{fsdp_param.fqn}': a copy of it failed to step "
        f"a test tensor ({error}); say it with lightning_fsdp.declare_update_scope({name}, 'elementwise' | 'tensor' "
        "| 'across_tensors') before its first step."
    )
