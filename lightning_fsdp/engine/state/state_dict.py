"""State dicts of a sharded model in two forms, with the original names and shapes.

- full: plain tensors, gathered unit by unit from the (fp32 master) shards straight to CPU on rank 0. Rank 0 holds
  the full model in CPU memory plus one gathered unit on the device; the other ranks hold nothing beyond one unit.
- sharded: every sharded parameter as a ``DTensor`` with ``Shard(0)`` over its shard group (``Replicate`` across
  HYBRID_SHARD's replicas) that *aliases* the local shard. ``torch.distributed.checkpoint`` saves that without a
  copy and, on load, writes every rank's rows straight into the shards, resharding from whatever world size
  saved them.

Buffers are not sharded; both forms hold rank 0's (see [Note: buffers are rank 0's at every checkpoint] in
``module_buffers.py``). Loading a full state dict, every rank copies its own rows out of it, and a checkpoint for
another model is refused before anything is changed. The sharded module's own ``load_state_dict`` takes a full state
dict the same way (see [Note: loading through the modules' own hooks] in ``load_hooks.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_fsdp.engine.features.module_buffers import broadcast_buffers
from lightning_fsdp.engine.optimizers import prepare_optimizer
from lightning_fsdp.engine.runtime.masters import gather_masters
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.registry import fsdp_param_of, units_under
from lightning_fsdp.engine.runtime.unit import TrainingState
from lightning_fsdp.engine.transport.framing import all_gather_flat


def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, Tensor]:
    """``module.state_dict()`` with full tensors on the CPU: on rank 0 only (``{}`` elsewhere) unless told otherwise.

    Sharded parameters are gathered from the shards themselves -- the fp32 master weights the optimizer steps --
    never from the forward's unsharded tensors, which mixed precision keeps in ``param_dtype``: a checkpoint holds
    exactly the values training will continue from. A collective: call it on every rank.
    """
    check_idle(module, "full_state_dict")
    broadcast_buffers(module)  # see [Note: buffers are rank 0's at every checkpoint]
    keep = not rank0_only or dist.get_rank() == 0
    gathered: dict[int, Tensor] = {}
    with torch.no_grad():
        for unit in units_under(module):
            for fsdp_param, full in gather_masters(unit.params, unit.wholes):
                if keep:
                    gathered[id(fsdp_param)] = full.to("cpu", copy=True)
    if not keep:
        return {}
    state: dict[str, Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        fsdp_param = fsdp_param_of(value)
        state[name] = gathered[id(fsdp_param)] if fsdp_param is not None else value.detach().to("cpu", copy=True)
    return state


def sharded_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every shard as a DTensor aliasing it; loading into it loads into the model, but
    for 0-dim parameters, whose entries are copies: pass the loaded dict to ``write_back_scalars``.

    A collective: every rank takes rank 0's buffers first (see [Note: buffers are rank 0's at every checkpoint]).
    """
    check_idle(module, "sharded_state_dict")
    broadcast_buffers(module)
    state = {name: as_dtensor(value) for name, value in module.state_dict(keep_vars=True).items()}
    return {name: value for name, value in state.items() if value is not None}


def write_back_scalars(module: nn.Module, model_state: Mapping[str, Any]) -> None:
    """After an in-place load (``torch.distributed.checkpoint.load``) into ``sharded_state_dict``: copy the values of
    sharded 0-dim parameters into the one rank that holds their row. Their checkpoint form is a copy of the value on
    every rank (there is no row to alias on the others), so the load changed only the copy. (Their optimizer state
    lives on that rank alone and loads in place.)
    """
    with torch.no_grad():
        for name, value in module.state_dict(keep_vars=True).items():
            if name in model_state and _is_scalar_shard(value):
                _copy_scalar(value.detach(), model_state[name])


def _is_scalar_shard(value: Tensor) -> bool:
    fsdp_param = fsdp_param_of(value) if isinstance(value, nn.Parameter) else None
    return fsdp_param is not None and fsdp_param.layout.world_size > 1 and len(fsdp_param.shape) == 0


def _is_per_row(value: Any, param: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape


def _copy_scalar(local: Tensor, loaded: Tensor) -> None:
    if local.numel():  # the rank holding the one row
        local.reshape(-1)[:1].copy_(loaded.reshape(-1))


def as_dtensor(value: Tensor) -> Tensor | None:
    """A registered tensor in its sharded-checkpoint form: a DTensor for a shard, the tensor itself otherwise; a tensor
    held whole (see [Note: whole tensors] in whole_tensors.py) as itself on its owner, None on the other ranks (DCP
    saves what any rank gives and loads each rank's own, so the checkpoint holds the same as for rows)."""
    fsdp_param = fsdp_param_of(value) if isinstance(value, nn.Parameter) else None
    if fsdp_param is not None and fsdp_param.layout.owner is not None:
        return value.detach() if fsdp_param.layout.owner == fsdp_param.layout.rank else None
    if fsdp_param is None or fsdp_param.layout.world_size == 1 or len(fsdp_param.shape) == 0:
        return _whole(value, fsdp_param)
    return _shard_dtensor(value.detach(), fsdp_param)


def _shard_dtensor(local: Tensor, fsdp_param: FSDPParam) -> DTensor:
    """The shard as its DTensor, with no copy: the engine's row split (rank r: rows [r*c, (r+1)*c), c = ceil(rows / W))
    is ``torch.chunk``'s, which is DTensor's ``Shard(0)``. 0-dim parameters (one row on rank 0) are stored whole instead
    (``_whole``)."""
    mesh, placements = _mesh_of(fsdp_param)
    stride = torch.empty(fsdp_param.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=fsdp_param.shape, stride=stride)


def _whole(value: Tensor, fsdp_param: FSDPParam | None) -> Tensor:
    if fsdp_param is None or fsdp_param.layout.world_size == 1:
        return value.detach().view(fsdp_param.shape) if fsdp_param is not None else value.detach()
    # A 0-dim parameter: its one row lives on the shard group's first rank; give every rank the value.
    scalar = value.detach().reshape(-1)[:1].clone() if value.numel() else value.new_zeros(1)
    dist.broadcast(scalar, src=dist.get_global_rank(fsdp_param.group, 0), group=fsdp_param.group)
    return scalar.view(fsdp_param.shape)


_MESHES: dict[tuple[int, ...], DeviceMesh] = {}  # by the groups' ids, which the meshes keep alive (so unique)


def forget_meshes() -> None:
    """Drop the meshes made so far, and with them their hold on the process groups: a run's end (``release.py``)."""
    _MESHES.clear()


def _mesh_of(fsdp_param: FSDPParam) -> tuple[DeviceMesh, list]:
    """The mesh a shard's DTensor lives on: its shard group, under HYBRID_SHARD also its replicas (a collective)."""
    groups = [g for g in (fsdp_param.replicate_group, fsdp_param.group) if g is not None]
    key = tuple(id(g) for g in groups)
    if key not in _MESHES:
        device_type = fsdp_param.compute_device.type
        if len(groups) == 1:
            _MESHES[key] = DeviceMesh.from_group(groups[0], device_type)
        else:
            replicate, shard = groups
            ranks = [dist.get_process_group_ranks(shard)]
            others = [None] * replicate.size()
            dist.all_gather_object(others, ranks[0], group=replicate)
            _MESHES[key] = DeviceMesh.from_group(
                groups, device_type, mesh=torch.tensor(others), mesh_dim_names=("replicate", "shard")
            )
    placements = [Shard(0)] if len(groups) == 1 else [Replicate(), Shard(0)]
    return _MESHES[key], placements


def load_full_state_dict(module: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load full tensors into the sharded module: every rank copies its own rows (shapes checked first). Read the file
    with ``torch.load(mmap=True)`` and no rank materialises more than the one tensor it is slicing."""
    check_idle(module, "load_full_state_dict")
    targets = module.state_dict(keep_vars=True)
    check_keys_and_shapes(targets, state, strict, full_shapes=True)
    with torch.no_grad():
        for name, target in targets.items():
            if name not in state:
                continue
            copy_full_value(target, state[name])


def copy_full_value(target: Tensor, value: Tensor) -> None:
    """Copy ``value`` into a registered tensor: this rank's rows of it into a shard when it has the parameter's full
    shape, as it is otherwise (a buffer, a parameter kept whole, a shard's own rows). Shapes are the caller's check."""
    fsdp_param = fsdp_param_of(target)
    if fsdp_param is None or tuple(value.shape) != tuple(fsdp_param.shape):
        target.copy_(value)
        return
    target.copy_(fsdp_param.layout.local_rows_of(value).reshape(target.shape))


def check_keys_and_shapes(
    targets: Mapping[str, Tensor], source: Mapping[str, Any], strict: bool, full_shapes: bool
) -> None:
    """Refuse a state dict of another model in one sentence that names what differs."""
    missing = sorted(set(targets) - set(source))
    unexpected = sorted(set(source) - set(targets))
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name in sorted(set(targets) & set(source)):
        fsdp_param = fsdp_param_of(targets[name])
        expected = fsdp_param.shape if (full_shapes and fsdp_param is not None) else targets[name].shape
        found = getattr(source[name], "shape", None)
        if found is not None and tuple(found) != tuple(expected):
            problems.append(f"'{name}' has shape {tuple(found)} in the checkpoint but {tuple(expected)} in the model")
    if problems:
        raise ValueError(
            "the checkpoint does not match this model: " + "; ".join(problems[:6]) + ". Load a checkpoint of the "
            "same model architecture (or pass strict=False to skip missing and unexpected keys)."
        )


def check_idle(module: nn.Module, what: str) -> None:
    """Refuse ``what`` while a unit under ``module`` is inside its forward or backward (parameters gathered)."""
    busy = [u for u in units_under(module) if u.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(f"{what} was called during forward or backward; call it between training steps.")


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every state tensor (a step with zero gradients and zero learning rate), so a checkpoint can load into it.

    Optimizers create their state lazily at the first step; a sharded load writes into existing tensors.
    """
    prepare_optimizer(optimizer)  # before the zero learning rate below, at which no step shows what it reads
    if optimizer.state:
        return
    saved_lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], Tensor) else 0.0
        for param in group["params"]:
            if param.grad is None and param.requires_grad and param.numel():  # an empty shard gets no gradient
                param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
        if lr is not None:
            group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, per-row tensors as DTensors aliasing the local state.

    ``{"state": {name: {key: value}}, "param_groups": [{hyperparameters..., "params": [name, ...]}]}``. A state
    tensor shaped like its shard (Adam's moments) becomes a ``Shard(0)`` DTensor of the full shape; anything else
    (a step count) stays as it is. A tensor held whole has its state on its owner only, as it is.
    """
    names = parameter_names(module)
    state: dict[str, dict[str, Any]] = {}
    for param, param_state in optimizer.state.items():
        state[names[id(param)]] = {key: _state_as_dtensor(value, param) for key, value in param_state.items()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def _state_as_dtensor(value: Any, param: Tensor) -> Any:
    fsdp_param = fsdp_param_of(param)
    if fsdp_param is None or not _is_per_row(value, param) or fsdp_param.layout.world_size == 1:
        return value
    if fsdp_param.layout.owner is not None or fsdp_param.layout.rows <= 1:  # on one rank, which alone has state
        return value.view(fsdp_param.shape)
    return _shard_dtensor(value, fsdp_param)


def full_param_state(param: Tensor, state: Mapping[str, Any]) -> dict[str, Any]:
    """One parameter's optimizer state at full shapes, on every rank of its shard group: tensors shaped like the
    parameter's rows gathered from every rank's, anything else as the rank holding the first rows (or the whole
    tensor) keeps it. ``state`` is this rank's, empty where it holds no element of the parameter. A collective over the
    shard group: every rank calls it for the same parameters in the same order."""
    fsdp_param = fsdp_param_of(param)
    if fsdp_param is None or fsdp_param.layout.world_size == 1:
        return dict(state)
    layout, group = fsdp_param.layout, fsdp_param.group
    holder = layout.owner if layout.owner is not None else 0
    mine = {key: (_on_cpu(value), _is_per_row(value, param)) for key, value in state.items()}
    one_holder = layout.owner is not None or layout.rows <= 1  # one rank holds every row: its state is the state
    if not one_holder:  # per-row tensors go by their rows below: say only their dtype here
        mine = {key: (value.dtype, True) if per_row else (value, False) for key, (value, per_row) in mine.items()}
    described = [mine if layout.rank == holder else None]
    dist.broadcast_object_list(described, src=dist.get_global_rank(group, holder), group=group)
    if one_holder:
        shaped = {
            key: value.reshape(fsdp_param.shape) if per_row else value for key, (value, per_row) in described[0].items()
        }
        return shaped
    return {
        key: _gather_rows(fsdp_param, state.get(key), value) if per_row else value
        for key, (value, per_row) in described[0].items()
    }


def _on_cpu(value: Any) -> Any:
    """A state value as it can travel between ranks (pickled: a CUDA tensor would land on the sender's device)."""
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _gather_rows(fsdp_param: FSDPParam, local: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The full tensor of a per-row value whose rows the ranks hold as they hold the parameter's (None: no rows)."""
    layout = fsdp_param.layout
    padded = torch.zeros(layout.shard_numel, dtype=dtype, device=fsdp_param.compute_device)
    if local is not None and local.numel():
        padded[: local.numel()].copy_(fsdp_param.flat(local.detach()))
    output = padded.new_empty(layout.world_size * layout.shard_numel)
    all_gather_flat(output, padded, group=fsdp_param.group)
    return fsdp_param.laid_out(output[: fsdp_param.shape.numel()], fsdp_param.shape)


def apply_optimizer_hyperparameters(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Take a checkpoint's per-group hyperparameters (learning rates a scheduler moved, say) after a load."""
    current = [len(group["params"]) for group in optimizer.param_groups]
    saved = [len(group["params"]) for group in groups]
    if current != saved:
        raise ValueError(
            f"the checkpoint's optimizer has parameter groups of sizes {saved} but this optimizer has {current}; "
            "resume with the configure_optimizers the checkpoint was trained with."
        )
    for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Parameter identity to name; a tied parameter takes its first name, as ``named_parameters`` gives it."""
    return {id(param): name for name, param in module.named_parameters()}
