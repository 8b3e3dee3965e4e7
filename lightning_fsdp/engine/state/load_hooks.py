"""``model.load_state_dict(full_state_dict)`` on a sharded model, through the modules' own loading code.

A load pre-hook on every module of the sharded model takes that module's entries, by their final keys, out of the state
dict; the post-hook of the module that owns the call checks every taken key and full shape, and only then copies each
rank's rows. See [Note: loading through the modules' own hooks], above ``install_load_hooks``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakSet

import torch
from torch import Tensor, nn

from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import check_idle, copy_full_value

_HOOKED: WeakSet[nn.Module] = WeakSet()


@dataclass
class _Taken:
    key: str
    target: Tensor
    value: Tensor


@dataclass
class _Load:
    """One ``load_state_dict`` call in progress, known by torch's ``missing_keys`` list (one new list per call)."""

    owner: nn.Module
    missing_keys: list[str]
    error_msgs: list[str]
    taken: list[_Taken] = field(default_factory=list)


_active: list[_Load] = []  # the call in progress, if any (a list of at most one, so no global statement is needed)


# [Note: loading through the modules' own hooks] After ``fully_shard`` every registered parameter is this rank's rows,
# so torch's own copy would refuse a full tensor (size mismatch). Modules also rename keys while they load (LitGPT's
# LoRA attention maps ``qkv.weight`` to ``qkv.linear.weight`` in its ``_load_from_state_dict`` before calling
# ``super()``), so the keys are only final when ``nn.Module._load_from_state_dict`` of the module that owns a tensor
# starts: it runs the module's load pre-hooks first, after every ancestor's renaming and the module's own. A pre-hook on
# every module of the sharded model (``_take_own_entries``) therefore sees its own final keys, and takes its entries out
# of the state dict so that torch copies nothing. The first hooked module a ``load_state_dict`` call reaches owns the
# call: in its post-hook (``_check_and_copy``), which runs after all of its descendants, every taken key is checked
# (torch's strict key check, then each value's shape against the parameter's *full* shape) and only then copied, each
# rank keeping its rows of every full tensor (``copy_full_value``). A refusal therefore changes nothing: torch raises
# its usual missing/unexpected keys error, or we raise one sentence for a shape. Only full shapes are taken, as torch's
# FSDP takes a full state dict: a value shaped like this rank's rows could as well be another model's full tensor, so it
# is refused.
#
# Torch calls every ``_load_from_state_dict`` with ``strict=True`` whatever the caller asked; only the
# ``load_state_dict`` frame knows, so the post-hook reads ``strict`` there (``_caller_strict``): keys that are missing
# under ``strict=False`` must not stop the copy, and under ``strict=True`` torch raises right after our post-hook.
# Pre-hooks registered after ``fully_shard`` run after ours and no longer see the module's entries.
def install_load_hooks(module: nn.Module) -> None:
    """Make ``module.load_state_dict`` take full state dicts; see [Note: loading through the modules' own hooks].

    Safe to call again (a nested ``fully_shard``): each module is hooked once."""
    for submodule in module.modules():
        if submodule in _HOOKED:
            continue
        submodule.register_load_state_dict_pre_hook(_take_own_entries)
        submodule.register_load_state_dict_post_hook(_check_and_copy)
        _HOOKED.add(submodule)


def _take_own_entries(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    load = _active[0] if _active else None
    if load is None or load.missing_keys is not missing_keys:  # the first hooked module of a new call
        check_idle(module, "load_state_dict")
        load = _Load(module, missing_keys, error_msgs)
        _active[:] = [load]
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            f"load_state_dict(assign=True) would replace {type(module).__name__}'s sharded parameters with the state "
            "dict's tensors; call load_state_dict without assign, and every rank copies its rows of each full tensor."
        )
    persistent_buffers = ((n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set)
    for name, target in (*module._parameters.items(), *persistent_buffers):
        key = prefix + name
        # Anything but a tensor stays for torch to report, as it would without sharding.
        if target is not None and torch.overrides.is_tensor_like(state_dict.get(key)):
            load.taken.append(_Taken(key, target, state_dict.pop(key)))


def _check_and_copy(module: nn.Module, incompatible_keys: Any) -> None:
    load = _active[0] if _active else None
    if load is None or load.owner is not module or load.missing_keys is not incompatible_keys.missing_keys:
        return  # not the module that owns the call: its descendants' entries wait for the owner's post-hook
    _active.clear()
    taken = {t.key for t in load.taken}
    incompatible_keys.missing_keys[:] = [key for key in incompatible_keys.missing_keys if key not in taken]
    if load.error_msgs:
        return  # torch raises them right after this hook; nothing was copied
    if incompatible_keys.missing_keys or incompatible_keys.unexpected_keys:
        strict = _caller_strict()
        if strict is None:
            raise ValueError(
                f"loading into the sharded {type(module).__name__} found missing keys "
                f"{incompatible_keys.missing_keys[:8]} and unexpected keys {incompatible_keys.unexpected_keys[:8]}, "
                "and no nn.Module.load_state_dict call says whether that is allowed; call module.load_state_dict."
            )
        if strict:
            return  # torch raises its usual missing/unexpected keys error; nothing was copied
    _check_shapes(load.taken)
    with torch.no_grad():
        for entry in load.taken:
            copy_full_value(entry.target, entry.value)


def _check_shapes(taken: list[_Taken]) -> None:
    """Every value has its tensor's full shape, or the load is refused in one sentence naming the first that differ."""
    wrong = []
    for entry in taken:
        fsdp_param = fsdp_param_of(entry.target)
        full = tuple(fsdp_param.shape) if fsdp_param is not None else tuple(entry.target.shape)
        if tuple(entry.value.shape) != full:
            found = tuple(entry.value.shape)
            wrong.append(f"'{entry.key}' has shape {found} in the state dict but {full} in the model")
    if wrong:
        raise ValueError(
            "load_state_dict into the sharded model was refused and nothing was loaded: "
            + "; ".join(wrong[:6])
            + (" ..." if len(wrong) > 6 else "")
            + ". Pass a full state dict of the same architecture, as the unsharded model's state_dict() or "
            "lightning_fsdp.engine.state.state_dict.full_state_dict(model) gives it (a sharded model's own "
            "state_dict() holds only this rank's rows)."
        )


def _caller_strict() -> bool | None:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call running this hook (None if there is none):
    torch passes every hook ``strict=True`` whatever the caller asked, see [Note: loading through the modules' own
    hooks]."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is nn.Module.load_state_dict.__code__:
            return bool(frame.f_locals["strict"])
        frame = frame.f_back
    return None
