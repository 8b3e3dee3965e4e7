"""Deferred initialisation: materialise a model built on the meta device module by module, in module order.

Each module with parameters or buffers of its own on the meta device gets real (uninitialised) tensors on the
target device and is then initialised by the user's ``param_init_fn(module)`` or its own ``reset_parameters()``,
which must touch only the module's own tensors -- as torch's built-in modules do. Module (pre-)order is the order
an eager ``__init__`` creates and initialises them in, so a seeded meta build gets exactly the eager values.
Whenever a unit's last parameter is ready the caller shards it, so the full tensors alive at any moment are one
unit's plus whatever its ancestors have materialised so far -- not the whole model.

A parameter shared by several modules (weight tying) is materialised once, under its first owner, and set on
every owner, so the tie survives; later owners find it real and are not re-initialised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ParamInitFn = Callable[[nn.Module], None]


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _own_meta(module: nn.Module) -> tuple[list[str], list[str]]:
    params = [name for name, p in module._parameters.items() if p is not None and p.is_meta]
    buffers = [name for name, b in module._buffers.items() if b is not None and b.is_meta]
    return params, buffers


def check_initializable(root: nn.Module, param_init_fn: ParamInitFn | None) -> None:
    """Refuse, before anything is materialised, a meta module that nothing knows how to initialise."""
    if param_init_fn is not None:
        return
    for name, module in root.named_modules():
        if any(_own_meta(module)) and not callable(getattr(module, "reset_parameters", None)):
            raise ValueError(
                f"module '{name or type(root).__name__}' ({type(module).__name__}) was built on the meta device but "
                "has no reset_parameters() to initialise its own tensors; give fully_shard a param_init_fn(module) "
                "that initialises it, or build that module on a real device."
            )


def materialize(
    root: nn.Module,
    device: torch.device,
    param_init_fn: ParamInitFn | None,
    owners_of: dict[int, list[tuple[nn.Module, str]]],
    on_param_ready: Callable[[nn.Parameter, nn.Parameter], None],
) -> None:
    """Materialise and initialise every meta tensor under ``root``; report each parameter as (meta, real)."""
    for module in root.modules():
        param_names, buffer_names = _own_meta(module)
        if not param_names and not buffer_names:
            continue
        for name in buffer_names:
            module._buffers[name] = torch.empty_like(module._buffers[name], device=device)
        ready = []
        for name in param_names:
            meta = module._parameters[name]
            real = nn.Parameter(torch.empty_like(meta, device=device), requires_grad=meta.requires_grad)
            for owner, attr in owners_of.get(id(meta), [(module, name)]):
                owner._parameters[attr] = real
            ready.append((meta, real))
        with torch.no_grad():
            if param_init_fn is not None:
                param_init_fn(module)
            else:
                module.reset_parameters()
        for meta, real in ready:
            on_param_ready(meta, real)
