"""``fully_shard``: turn a module into sharding units in place, names and structure unchanged."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp.engine.build.fingerprint import ParamPrint, UnitPrint, check_same_structure, values_differ
from lightning_fsdp.engine.build.groups import Groups, resolve_groups
from lightning_fsdp.engine.build.ownership import OwnedParam, assign_params
from lightning_fsdp.engine.build.policies import PolicyLike, WrapPolicy, as_wrap_policy, select_unit_modules
from lightning_fsdp.engine.features.host_memory import keep_freed_memory
from lightning_fsdp.engine.features.module_buffers import broadcast_from_first
from lightning_fsdp.engine.init.materialize import ParamInitFn, check_initializable, has_meta_tensors, materialize
from lightning_fsdp.engine.optimizers import install_step_hook
from lightning_fsdp.engine.options import (
    BackwardPrefetch,
    CrossHostPrecision,
    MixedPrecision,
    ShardingOptions,
    ShardingStrategy,
)
from lightning_fsdp.engine.runtime import hooks
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.registry import fsdp_param_of, register_unit, unit_of, units_under
from lightning_fsdp.engine.runtime.unit import FSDPUnit
from lightning_fsdp.engine.state.load_hooks import install_load_hooks
from lightning_fsdp.engine.state.optimizer_guard import record_replaced

log = logging.getLogger(__name__)


def fully_shard(
    module: nn.Module,
    policy: PolicyLike = None,
    *,
    sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
    process_group: ProcessGroup | None = None,
    device_mesh: DeviceMesh | tuple[int, int] | None = None,
    backward_prefetch: str | BackwardPrefetch | None = "BACKWARD_PRE",
    forward_prefetch: bool | None = None,
    limit_all_gathers: bool = True,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: bool = False,
    device: torch.device | str | None = None,
    param_init_fn: ParamInitFn | None = None,
    sync_module_states: bool = False,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
    reshard_after_forward: bool | int | None = None,
    cross_host_precision: CrossHostPrecision | str | None = None,
    gather_embedding_by_rows: bool = True,
) -> nn.Module:
    """Shard ``module`` in place across the ranks of ``process_group`` and return it.

    Every module the ``policy`` selects becomes a unit (bottom-up); ``module`` itself becomes the root unit and owns
    every parameter no other unit took. Each parameter is replaced by this rank's dim-0 shard under the same name,
    so build the optimizer afterwards: it then holds (and steps) only the shards. A unit is gathered whole for its
    forward and backward with one all-gather and reduces its gradients with one reduce-scatter. On CPU ranks it
    also keeps the host memory a step frees for the next one (``host_memory.py``; ``LIGHTNING_FSDP_KEEP_FREED_MEMORY=0``
    leaves malloc alone).

    Args:
        module: the model, on the device it will train on, or on the meta device (deferred init).
        policy: a set of module classes, a callable ``(module, recurse, nonwrapped_numel) -> bool`` (torch's
            auto-wrap protocol), or None for a single unit.
        sharding_strategy: ``"FULL_SHARD"`` (re-gather in backward), ``"SHARD_GRAD_OP"`` (keep gathered parameters
            until backward ends), ``"NO_SHARD"`` (replicate; all-reduce gradients) or ``"HYBRID_SHARD"``
            (FULL_SHARD within each shard group of ``device_mesh``, gradients also all-reduced across replicas).
        process_group: the ranks to shard over; the default group when None.
        device_mesh: HYBRID_SHARD only: a 2-D DeviceMesh (replicate, shard) or its sizes.
        backward_prefetch: gather the unit backward reaches next when the current one's backward starts
            (``"BACKWARD_PRE"``) or ends (``"BACKWARD_POST"``); None to gather on demand.
        forward_prefetch: gather the next unit of the forward order (recorded in the first step) ahead of time. None:
            when the unit's gathers cross hosts (see [Note: the link's queue] in ``root.py``); on one host it
            measured no gain.
        limit_all_gathers: allow at most two units to be gathered ahead of their use.
        mixed_precision: dtypes for the gathered parameters, the gradient reduction and the buffers; the shards
            (the optimizer's master weights) keep their own dtype.
        cpu_offload: keep the shards and their gradients in CPU memory (the optimizer steps there); each unshard
            copies the shard to the compute device first. On a CPU-only run it changes nothing.
        device: where a meta-device model is materialised; the current CUDA device under NCCL, else the CPU.
        param_init_fn: initialises one materialised module's own tensors. When None, a model built under
            ``track_meta_build()`` gets its recorded init replayed, any other its modules' ``reset_parameters()``.
            As in torch's FSDP, only modules with tensors on the meta device are materialised, so it is not called
            otherwise.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding, so every rank starts equal.
            Without it they are compared first and broadcast only where some rank built other values (an unseeded
            script), as DDP makes every rank start from rank 0's; other names, shapes, dtypes or units are refused
            with ``ModelMismatchError`` (see [Note: different values are made rank 0's] in ``fingerprint.py``).
        ignored_modules, ignored_params: left whole, on every rank, and untouched by the engine (their gradients
            are not reduced either).
        reshard_after_forward: as torch FSDP2's: True frees the full parameters after forward (backward gathers them
            again), False keeps them until backward ends, an int is the ranks to stay sharded over in between: the
            ranks per host of a group that spans hosts, so that backward gathers inside each host and nothing crosses
            the link (see docs/multi-node.md). None: what ``sharding_strategy`` does (True for FULL_SHARD and
            HYBRID_SHARD). Checked at the first forward, when the hosts are known.
        cross_host_precision: fewer bits for what crosses between hosts (CPU ranks): ``"bf16"``, ``"int8"`` or a
            ``CrossHostPrecision``; the computation and the master weights keep their dtypes. None: every bit.
        gather_embedding_by_rows: where a unit's gathers cross hosts, a training forward gathers the weight of an
            ``nn.Embedding`` no other module shares by the rows its lookups read, not whole; its other rows hold NaN
            until the unit reshards. False for a model that reads such a weight outside the embedding's own forward
            (see [Note: an embedding's rows as they are looked up] in ``embedding_rows.py``).
    """
    options = ShardingOptions.parse(
        sharding_strategy,
        backward_prefetch,
        forward_prefetch,
        limit_all_gathers,
        mixed_precision,
        cpu_offload,
        reshard_after_forward,
        cross_host_precision,
        gather_embedding_by_rows,
    )
    groups = resolve_groups(options.sharding_strategy, process_group, device_mesh)
    plan = _plan(module, as_wrap_policy(policy), groups, param_init_fn, ignored_modules, ignored_params)
    builder = _UnitBuilder(plan.assignment, groups, options, sync_module_states)
    for unit_module in plan.unit_modules:
        builder.expect(unit_module)
    if plan.deferred:
        owners_of = {id(o.param): o.owners for owned in plan.assignment.values() for o in owned}
        materialize(module, _materialize_device(device, groups), param_init_fn, owners_of, builder.param_ready)
    builder.build_remaining()
    _start_ranks_equal(module, builder, groups, sync_module_states)
    if options.mixed_precision.buffer_dtype is not None:
        _cast_buffers(module, options.mixed_precision.buffer_dtype)
    _make_root(module, plan, groups)
    return module


class _Plan(NamedTuple):
    """What one ``fully_shard`` call will do, decided and checked before it changes anything."""

    unit_modules: list[nn.Module]  # the units to build, bottom-up, the root last
    assignment: dict[nn.Module, list[OwnedParam]]  # each unit's parameters
    deferred: bool  # the model holds meta tensors, materialised as the units are built
    existing_units: list[FSDPUnit]  # units of earlier calls, below the new root
    model_bytes: int


def _plan(
    module: nn.Module,
    wrap_policy: WrapPolicy | None,
    groups: Groups,
    param_init_fn: ParamInitFn | None,
    ignored_modules: Iterable[nn.Module],
    ignored_params: Iterable[nn.Parameter],
) -> _Plan:
    """Choose the units and their parameters, and check every rank would build the same: a refusal leaves the model
    as it was."""
    if unit_of(module) is not None:
        raise ValueError(f"{type(module).__name__} is already sharded; call fully_shard once per module.")
    ignored_module_ids = {id(m) for root in ignored_modules for m in root.modules()}
    ignored_param_ids = {id(p) for p in ignored_params} | {
        id(p) for m in module.modules() if id(m) in ignored_module_ids for p in m.parameters(recurse=False)
    }
    is_unit = lambda m: unit_of(m) is not None  # noqa: E731
    children = (
        select_unit_modules(module, wrap_policy, is_unit, lambda m: id(m) in ignored_module_ids)
        if wrap_policy is not None
        else []
    )
    if wrap_policy is not None and not children:
        raise ValueError(_policy_wraps_nothing(module, wrap_policy))
    deferred = has_meta_tensors(module)
    if deferred:
        check_initializable(module, param_init_fn)
    new_units = {id(m) for m in (*children, module)}
    assignment = assign_params(
        module,
        is_unit_module=lambda m: id(m) in new_units or is_unit(m),
        skip=lambda p: fsdp_param_of(p) is not None or id(p) in ignored_param_ids,
    )
    unit_modules = [m for m in (*children, module) if m is module or assignment.get(m)]
    for unit_module in unit_modules:
        _check_uniform(unit_module, assignment.get(unit_module, []), devices=not deferred)
    if groups.sync.size() > 1:  # before any per-unit collective
        check_same_structure(*_structure_prints(module, unit_modules, assignment), groups.sync)
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return _Plan(unit_modules, assignment, deferred, units_under(module), model_bytes)


def _start_ranks_equal(module: nn.Module, builder: _UnitBuilder, groups: Groups, sync_module_states: bool) -> None:
    """The buffers as rank 0 has them where asked or where ranks differ (the units' parameters already are, see
    [Note: different values are made rank 0's] in ``fingerprint.py``), and one log line when values were taken."""
    if groups.sync.size() > 1:
        buffers = [b for b in module.buffers() if b.numel() > 0]
        if buffers and (sync_module_states or values_differ(buffers, groups.sync)):
            broadcast_from_first(buffers, groups.sync)
            builder.took_rank0.append("buffers")
    if builder.took_rank0 and not sync_module_states and dist.get_rank(groups.sync) == 0:
        log.info(
            "lightning_fsdp: ranks built %s with other initial values (in: %s); every rank took rank 0's parameters "
            "and buffers, as DDP does (seed every rank alike to skip the broadcast)",
            type(module).__name__,
            ", ".join(builder.took_rank0[:3]) + (", ..." if len(builder.took_rank0) > 3 else ""),
        )


def _make_root(module: nn.Module, plan: _Plan, groups: Groups) -> None:
    """``module`` becomes the root of every unit below it, with what a root brings: the guard on its children's
    calls, the marks libraries read, full state dicts in ``load_state_dict``, the optimizers' preparation."""
    for unit in plan.existing_units:
        unit.leave_root()  # the new root claims them at its first forward
    hooks.guard_ungathered_calls(unit_of(module))
    _mark_fsdp_managed(module)
    install_load_hooks(module)  # module.load_state_dict takes full state dicts: see load_hooks.py
    install_step_hook(module)  # see [Note: an optimizer is prepared before its first step] in optimizers/prepare.py
    if groups.sync.size() > 1 and unit_of(module).compute_device().type == "cpu":
        keep_freed_memory(plan.model_bytes)  # see [Note: freed memory stays with the process] in host_memory.py


def _mark_fsdp_managed(module: nn.Module) -> None:
    """Set the attributes torch's FSDP sets on the modules it manages, which libraries read to know that a forward
    is a collective: transformers' ``generate`` then keeps a rank that met its end token stepping (``synced_gpus``)
    until every rank is done, instead of leaving the others waiting in a gather forever. ``_fsdp_use_orig_params``
    says, truly, that the parameters are the original ones.

    Only ``module`` and the modules that hold units below them (the models and containers a library asks) are
    marked, never a unit's own modules: see [Note: units compile with static sizes].
    """
    with_units_below = {id(m) for m in module.modules() if any(unit.module is not m for unit in units_under(m))}
    for submodule in module.modules():
        if submodule is module or id(submodule) in with_units_below:
            submodule._is_fsdp_managed_module = True
            submodule._fsdp_use_orig_params = True
        else:  # a unit's module marked by its own earlier fully_shard call, now below this one
            submodule.__dict__.pop("_is_fsdp_managed_module", None)
            submodule.__dict__.pop("_fsdp_use_orig_params", None)


class _UnitBuilder:
    """Builds each unit as soon as all its parameters are real: at once, or when deferred init reaches them."""

    def __init__(
        self,
        assignment: dict[nn.Module, list[OwnedParam]],
        groups: Groups,
        options: ShardingOptions,
        sync_module_states: bool,
    ) -> None:
        self.assignment = assignment
        self.groups = groups
        self.options = options
        self.sync_module_states = sync_module_states
        self._pending: dict[int, int] = {}  # id(unit module) -> parameters still on the meta device
        self._unit_of_param: dict[int, nn.Module] = {}
        self._order: list[nn.Module] = []
        self.took_rank0: list[str] = []  # units (and "buffers") broadcast from rank 0, for the one log line

    def expect(self, unit_module: nn.Module) -> None:
        owned = self.assignment.get(unit_module, [])
        self._order.append(unit_module)
        self._pending[id(unit_module)] = sum(o.param.is_meta for o in owned)
        for o in owned:
            self._unit_of_param[id(o.param)] = unit_module

    def param_ready(self, meta: nn.Parameter, real: nn.Parameter) -> None:
        unit_module = self._unit_of_param.get(id(meta))
        if unit_module is None:  # an ignored parameter
            return
        for o in self.assignment[unit_module]:
            if o.param is meta:
                o.param = real
        self._pending[id(unit_module)] -= 1
        if self._pending[id(unit_module)] == 0:
            self._build(unit_module)

    def build_remaining(self) -> None:
        for unit_module in self._order:
            if self._pending.get(id(unit_module)) == 0 and unit_of(unit_module) is None:
                self._build(unit_module)

    def _build(self, unit_module: nn.Module) -> None:
        owned = self.assignment.get(unit_module, [])
        _check_uniform(unit_module, owned)
        tensors = [o.param for o in owned]
        if tensors and self.groups.sync.size() > 1:  # see [Note: different values are made rank 0's]
            if self.sync_module_states or values_differ(tensors, self.groups.sync):
                broadcast_from_first(tensors, self.groups.sync)
                self.took_rank0.append(f"unit {type(unit_module).__name__}")
        if self.options.keeps_replicas_in_place:
            unit = FSDPUnit(unit_module, [], [o.param for o in owned], self.groups.as_pair(), self.options)
        else:
            param_dtype = self.options.mixed_precision.param_dtype
            offload = self.options.cpu_offload
            shard_group = self.groups.shard
            replicate_group = self.groups.replicate if shard_group is not None else None
            alone = self.groups.sync.size() == 1
            params = [
                FSDPParam(o.param, o.fqn, o.owners, shard_group, param_dtype, offload, replicate_group, alone)
                for o in owned
            ]
            for fsdp_param, o in zip(params, owned, strict=True):
                fsdp_param.register_sharded()
                if fsdp_param.sharded is not o.param:
                    record_replaced(o.param, o.fqn)
            unit = FSDPUnit(unit_module, params, [], self.groups.as_pair(), self.options)
        register_unit(unit)
        hooks.install_hooks(unit)


def _materialize_device(device: torch.device | str | None, groups: Groups) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.get_backend(groups.sync) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _structure_prints(
    module: nn.Module, unit_modules: list[nn.Module], assignment: dict[nn.Module, list[OwnedParam]]
) -> tuple[list[UnitPrint], UnitPrint]:
    """What this call will shard, without values, in module order (as the root's lazy init lists units), and the
    buffers (broadcast as one more collective): names, shapes, dtypes and ``requires_grad`` only."""
    names = {id(m): name or "<root>" for name, m in module.named_modules()}
    position = {id(m): i for i, m in enumerate(module.modules())}
    prints = [
        UnitPrint(
            names[id(m)],
            type(m).__name__,
            tuple(
                ParamPrint(o.fqn, tuple(o.param.shape), str(o.param.dtype), o.param.requires_grad, None)
                for o in assignment.get(m, [])
            ),
        )
        for m in sorted(unit_modules, key=lambda m: position[id(m)])
    ]
    buffers = tuple(
        ParamPrint(name, tuple(b.shape), str(b.dtype), False, None)
        for name, b in module.named_buffers()
        if b.numel() > 0
    )
    return prints, UnitPrint("<buffers>", "buffers", buffers)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                submodule._buffers[name] = buffer.to(dtype)


def _check_uniform(module: nn.Module, owned: list[OwnedParam], devices: bool = True) -> None:
    """One flat buffer per unit needs one dtype and one device; say which parameters break that.

    ``devices=False`` before deferred init, while parameters are still on the meta device."""
    for attribute in ("dtype", "device") if devices else ("dtype",):
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
