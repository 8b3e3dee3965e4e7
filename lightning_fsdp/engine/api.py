"""``fully_shard``: turn a module into sharding units in place, names and structure unchanged."""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_fsdp.engine import hooks
from lightning_fsdp.engine.options import BackwardPrefetch, ShardingOptions, ShardingStrategy
from lightning_fsdp.engine.ownership import OwnedParam, assign_params
from lightning_fsdp.engine.param import FSDPParam
from lightning_fsdp.engine.policies import PolicyLike, as_wrap_policy, select_unit_modules
from lightning_fsdp.engine.registry import fsdp_param_of, register_unit, unit_of, units_under
from lightning_fsdp.engine.unit import FSDPUnit


def fully_shard(
    module: nn.Module,
    policy: PolicyLike = None,
    *,
    sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
    process_group: ProcessGroup | None = None,
    backward_prefetch: str | BackwardPrefetch | None = "BACKWARD_PRE",
    forward_prefetch: bool = False,
    limit_all_gathers: bool = True,
) -> nn.Module:
    """Shard ``module`` in place across the ranks of ``process_group`` and return it.

    Every module the ``policy`` selects becomes a unit (bottom-up); ``module`` itself becomes the root unit and owns
    every parameter no other unit took. Each parameter is replaced by this rank's dim-0 shard under the same name,
    so build the optimizer afterwards: it then holds (and steps) only the shards. A unit is gathered whole for its
    forward and backward with one all-gather and reduces its gradients with one reduce-scatter.

    Args:
        module: the model, on the device it will train on.
        policy: a set of module classes, a callable ``(module, recurse, nonwrapped_numel) -> bool`` (torch's
            auto-wrap protocol), or None for a single unit.
        sharding_strategy: ``"FULL_SHARD"`` (re-gather in backward), ``"SHARD_GRAD_OP"`` (keep gathered parameters
            until backward ends) or ``"NO_SHARD"`` (replicate; all-reduce gradients).
        process_group: the ranks to shard over; the default group when None.
        backward_prefetch: gather the unit backward reaches next when the current one's backward starts
            (``"BACKWARD_PRE"``) or ends (``"BACKWARD_POST"``); None to gather on demand.
        forward_prefetch: gather the next unit of the forward order (recorded in the first step) ahead of time.
        limit_all_gathers: allow at most two units to be gathered ahead of their use.
    """
    options = ShardingOptions.parse(sharding_strategy, backward_prefetch, forward_prefetch, limit_all_gathers)
    group = _resolve_group(process_group)
    if unit_of(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded; call fully_shard once per module.")
    wrap_policy = as_wrap_policy(policy)
    children = select_unit_modules(module, wrap_policy, _is_unit) if wrap_policy is not None else []
    if wrap_policy is not None and not children:
        raise ValueError(_policy_wraps_nothing(module, wrap_policy))
    existing_units = units_under(module)
    new_units = {id(m) for m in (*children, module)}
    assignment = assign_params(
        module,
        is_unit_module=lambda m: id(m) in new_units or unit_of(m) is not None,
        skip=lambda p: fsdp_param_of(p) is not None,
    )
    for unit_module in (*children, module):
        owned = assignment.get(unit_module, [])
        if owned or unit_module is module:
            _make_unit(unit_module, owned, group, options)
    for unit in existing_units:
        unit.context = None  # the new root claims them at its first forward
    return module


def _is_unit(module: nn.Module) -> bool:
    return unit_of(module) is not None


def _resolve_group(process_group: ProcessGroup | None) -> ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialized: call torch.distributed.init_process_group() "
            "first, or launch the script with torchrun."
        )
    return process_group if process_group is not None else dist.group.WORLD


def _make_unit(module: nn.Module, owned: list[OwnedParam], group: ProcessGroup, options: ShardingOptions) -> None:
    _check_uniform(module, owned)
    if options.shards_parameters:
        params = [FSDPParam(o.param, o.fqn, o.owners, group) for o in owned]
        for fsdp_param in params:
            fsdp_param.register_sharded()
        unit = FSDPUnit(module, params, [], group, options)
    else:
        unit = FSDPUnit(module, [], [o.param for o in owned], group, options)
    register_unit(unit)
    hooks.install_hooks(unit)


def _check_uniform(module: nn.Module, owned: list[OwnedParam]) -> None:
    """One flat buffer per unit needs one dtype and one device; say which parameters break that."""
    for attribute in ("dtype", "device"):
        values = Counter(str(getattr(o.param, attribute)) for o in owned)
        if len(values) > 1:
            odd = [o.fqn for o in owned if str(getattr(o.param, attribute)) != values.most_common(1)[0][0]]
            raise ValueError(
                f"the unit {type(module).__name__} holds parameters of different {attribute}s ({dict(values)}; "
                f"odd ones: {odd[:5]}); one unit packs its parameters into one buffer, so move them to one "
                f"{attribute} before fully_shard or put the odd ones in a unit of their own through the policy."
            )


def _policy_wraps_nothing(module: nn.Module, policy: object) -> str:
    repeated = Counter(
        type(m).__name__
        for m in module.modules()
        if m is not module and not isinstance(m, nn.ModuleList | nn.ModuleDict) and any(True for _ in m.parameters())
    )
    hint = ", ".join(name for name, count in repeated.most_common(3) if count > 1) or "its largest submodules"
    return (
        f"the auto-wrap policy {policy!r} selects no submodule of {type(module).__name__}, so the whole model would "
        f"be one unit gathered at once; pass the classes of its repeated blocks (candidates: {hint}), or "
        f"policy=None to shard the model as a single unit on purpose."
    )
