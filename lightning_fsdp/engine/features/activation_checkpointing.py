"""Activation checkpointing by policy: chosen modules keep only their inputs and recompute the rest in backward.

The module's ``forward`` is replaced on the instance by one that runs the original under
``torch.utils.checkpoint`` (non-reentrant), so names, structure and the engine's hooks -- which sit on
``__call__``, around ``forward`` -- stay as they are. In backward the unit's pre-backward hook has already gathered
its parameters when the recomputation runs, so recomputation sees the full tensors, and units nested inside a
checkpointed module are gathered again by their own hooks as the recomputed forward reaches them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint
from torch import nn

from lightning_fsdp.engine.build.policies import PolicyLike, as_wrap_policy


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def apply_activation_checkpointing(module: nn.Module, policy: PolicyLike) -> nn.Module:
    """Checkpoint every submodule the policy selects (a set of classes, or a callable as for auto-wrapping).

    Call it before or after ``fully_shard``; either order gives the same result. Returns ``module``.
    """
    check = as_wrap_policy(policy)
    if check is None:
        raise ValueError("apply_activation_checkpointing needs a policy: a set of module classes or a callable.")
    selected = [
        m
        for m in module.modules()
        if not is_checkpointed(m)
        and check(module=m, recurse=False, nonwrapped_numel=sum(p.numel() for p in m.parameters()))
    ]
    if not selected:
        raise ValueError(
            f"the activation checkpointing policy {policy!r} selects no submodule of {type(module).__name__}; "
            "pass the classes of its repeated blocks."
        )
    for submodule in selected:
        submodule.forward = functools.partial(_checkpointed_forward, submodule.forward)
    return module
