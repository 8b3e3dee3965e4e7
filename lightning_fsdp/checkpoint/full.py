"""The full form: whole tensors on rank 0, and optimizer state in ``Optimizer.state_dict()``'s own format.

Optimizer state is positional (parameter ``i`` of the groups, in order), like every optimizer's own state dict,
so a ddp or single-device run loads it as its own. ``full_optimizer_state`` (the engine's and Fabric's form) also
records each group's ``param_names``, which ``convert`` needs and ``Optimizer.load_state_dict`` accepts (it matches by
position and keeps them as the groups' names). The Trainer's ``optimizer_state`` is ``torch_optimizer_state``:
exactly ``optimizer.state_dict()``'s keys, what ddp's gives and Lightning compares; the names ``convert`` needs then
go beside it, under the file's own entry (``record_optimizer_names``). Files with ``param_names`` in their groups
(written before, or by the engine or ``convert``) load as they always did.
Gathering goes one state tensor at a time, so rank 0 holds the full state plus one tensor; loading slices each
full tensor down to this rank's rows.

The file is written by ``torch.save`` straight into a temporary sibling (see ``atomic.py``): Lightning's
``TorchCheckpointIO`` makes its save atomic by serializing the whole checkpoint into memory first, which doubles
rank 0's peak (measured in benchmarks/bench_checkpoint.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.atomic import tensor_bytes, write_file_atomically
from lightning_fsdp.checkpoint.callback_tensors import check_full_callback_tensors, fold_callback_tensors
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.optimizer_check import check_optimizer_fits, optimizers_restored_on_error
from lightning_fsdp.checkpoint.remote import downloaded_once_per_host
from lightning_fsdp.checkpoint.safe_load import load_torch_file
from lightning_fsdp.engine.optimizers import prepare_optimizer
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import (
    check_keys_and_shapes,
    full_param_state,
    init_optimizer_state,
    load_full_state_dict,
    parameter_names,
)

# The checkpoint entry that says it holds only the trainable parameters (an adapter, LoRA's A and B): loading it
# leaves every other parameter as the model has it (the base weights), and refuses only names the model lacks.
OWN_KEY = "lightning_fsdp"
# A full file ``fabric.save`` writes keeps the user's keys (``{"model": ..., "optimizer": ..., "iter_num": ...}``), as
# Lightning's Fabric does; what our loaders need beside them (which key is the module, which are the optimizers, the
# Lightning version) lies under this one private key. See ``as_trainer_layout``.
FABRIC_KEY = "_lightning_fsdp"
# Under OWN_KEY: per optimizer, per group, the names of its parameters in position order -- what ``convert`` keys a
# positional optimizer state by when its groups do not carry ``param_names`` (see ``record_optimizer_names``).
NAMES_KEY = "optimizer_param_names"
VERSION_KEY = "pytorch-lightning_version"


def mark_trainable_only(checkpoint: dict[str, Any]) -> None:
    checkpoint[OWN_KEY] = {**checkpoint.get(OWN_KEY, {}), "trainable_only": True}


def is_trainable_only(checkpoint: dict[str, Any]) -> bool:
    entry = checkpoint.get(OWN_KEY)
    return isinstance(entry, dict) and entry.get("trainable_only") is True


def check_no_unexpected(model_names: set[str], saved_names: set[str], source: object) -> None:
    """A trainable-only checkpoint may lack the model's names (the base weights), never name what it does not have."""
    unexpected = sorted(saved_names - model_names)
    if unexpected:
        raise ValueError(
            f"the checkpoint at {source} holds parameters this model does not have ({unexpected[:8]}); load it into "
            "the model (with the adapters) it was trained with."
        )


def save_full_checkpoint(path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` to ``path`` atomically, streaming it to disk: no second copy in memory (one process)."""
    write_file_atomically(path, lambda tmp: torch.save(checkpoint, tmp), expected_bytes=tensor_bytes(checkpoint))


def load_full_checkpoint(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    trust: bool = False,
    opt_in: str = "trust=True",
    callback_tensors: Mapping[str, dict[str, Tensor]] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a full checkpoint file (ours, ddp's, one device's) into the sharded ``module`` and ``optimizers``; return
    the rest of it. Everything is checked -- keys, shapes, optimizer count, type, grouping, state shapes, the
    per-rank tensors of ``callback_tensors``' callbacks (see ``callback_tensors.py``) -- before the first tensor
    changes. Read memory-mapped: each rank copies its rows without a second full copy. An object at an fsspec URL
    is downloaded once per host for that (a collective; see ``remote.py``).
    """
    if is_remote(path):
        with downloaded_once_per_host(path, storage_options) as local:
            checkpoint = load_torch_file(local, trust, opt_in)
    else:
        checkpoint = load_torch_file(path, trust, opt_in)
    return load_full_state(checkpoint, path, module, optimizers, strict, callback_tensors)


def as_trainer_layout(checkpoint: Any) -> list[str] | None:
    """A full file ``fabric.save`` wrote, put into the Trainer's layout in place: the module's state under
    ``state_dict``, the optimizers' (positional) under ``optimizer_states``, the Lightning version a Trainer needs.

    Returns the optimizers' names in saved order; None (the checkpoint left as it is) for any other file.
    """
    record = checkpoint.get(FABRIC_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(record, dict) or "state_dict" in checkpoint or record.get("module") not in checkpoint:
        return None
    names = [name for name in record.get("optimizers", []) if name in checkpoint]
    checkpoint["state_dict"] = checkpoint.pop(record["module"])
    checkpoint["optimizer_states"] = [positional_optimizer_state(checkpoint.pop(name)) for name in names]
    del checkpoint[FABRIC_KEY]
    if isinstance(record.get("lightning_version"), str):
        checkpoint.setdefault(VERSION_KEY, record["lightning_version"])
    return names


def named_optimizer_state(positional: dict[str, Any]) -> dict[str, Any]:
    """``full_optimizer_state``'s positional form keyed by parameter name instead, as Lightning's Fabric FSDP writes
    a full optimizer state (``FSDP.optim_state_dict``): ``{"state": {name: ...}, "param_groups": [{..., "params":
    [name, ...]}]}``. ``Optimizer.load_state_dict`` of the unsharded model takes it too (it matches by position)."""
    if not positional:
        return positional
    groups = positional["param_groups"]
    names = [name for group in groups for name in group["param_names"]]
    return {
        "state": {names[int(index)]: state for index, state in positional["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": list(g["param_names"])}
            for g in groups
        ],
    }


def positional_optimizer_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (``named_optimizer_state``, the sharded form, Lightning's FSDP) in
    ``Optimizer.state_dict()``'s positional form with each group's ``param_names``; a positional one as it is."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not groups or not all(isinstance(name, str) for group in groups for name in group["params"]):
        return saved
    index_of = {name: i for i, name in enumerate(n for group in groups for n in group["params"])}
    state = {index_of[name]: values for name, values in saved.get("state", {}).items()}
    positional_groups, start = [], 0
    for group in groups:
        count = len(group["params"])
        positional_groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": list(range(start, start + count)),
                "param_names": list(group["params"]),
            }
        )
        start += count
    return {"state": state, "param_groups": positional_groups}


def load_full_state(
    checkpoint: Any,
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    callback_tensors: Mapping[str, dict[str, Tensor]] | None = None,
) -> dict[str, Any]:
    """``load_full_checkpoint`` of a checkpoint already read from ``path`` (which names it in messages); a file in
    ``fabric.save``'s layout is put into the Trainer's first (see ``as_trainer_layout``)."""
    for optimizer in optimizers:  # the layout its state is saved for decides where the model's shards live
        prepare_optimizer(optimizer)
    as_trainer_layout(checkpoint)
    fold_callback_tensors(checkpoint)  # a file Lightning consolidated from our sharded folder
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise ValueError(f"{path} is not a Lightning checkpoint: it has no 'state_dict'; pass a .ckpt a Trainer saved.")
    if is_trainable_only(checkpoint):
        check_no_unexpected(set(module.state_dict(keep_vars=True)), set(checkpoint["state_dict"]), path)
        strict = False
    check_keys_and_shapes(module.state_dict(keep_vars=True), checkpoint["state_dict"], strict, full_shapes=True)
    check_full_callback_tensors(checkpoint, callback_tensors or {}, path)
    # Name-keyed states (a file Lightning consolidated from a sharded folder) in the positional form, with names.
    saved_optimizers = [positional_optimizer_state(state) for state in checkpoint.pop("optimizer_states", [])]
    if optimizers and len(saved_optimizers) != len(optimizers):
        raise ValueError(
            f"the checkpoint at {path} holds {len(saved_optimizers)} optimizer state(s) but the model has "
            f"{len(optimizers)} optimizer(s); resume with the configure_optimizers it was trained with."
        )
    with optimizers_restored_on_error(optimizers):
        for optimizer, state in zip(optimizers, saved_optimizers, strict=False):  # none when not fitting
            check_full_optimizer_state(module, optimizer, state, path)
    load_full_state_dict(module, checkpoint.pop("state_dict"), strict=strict)
    for optimizer, state in zip(optimizers, saved_optimizers, strict=False):
        load_full_optimizer_state(module, optimizer, state)
    return checkpoint


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` at full shapes, on rank 0 (``{}`` elsewhere). A collective."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    names = parameter_names(module)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        indices = []
        for param in group["params"]:
            full = full_param_state(param, optimizer.state.get(param, {}))
            if rank0 and full:
                state[index] = {
                    k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in full.items()
                }
            indices.append(index)
            index += 1
        hyperparameters = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**hyperparameters, "params": indices, "param_names": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups} if rank0 else {}


def torch_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``full_optimizer_state`` in exactly ``optimizer.state_dict()``'s layout, as ddp's ``optimizer_state`` gives it:
    a group has ``param_names`` only where the optimizer's own group has them (an optimizer built from
    ``named_parameters``), and then its own. On rank 0 (``{}`` elsewhere). A collective."""
    state = full_optimizer_state(module, optimizer)
    if not state:
        return state
    groups = []
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        group = {key: value for key, value in saved.items() if key != "param_names"}
        if "param_names" in live:
            group["param_names"] = list(live["param_names"])
        groups.append(group)
    return {"state": state["state"], "param_groups": groups}


def record_optimizer_names(checkpoint: dict[str, Any], module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Record in ``checkpoint``'s own entry which parameter each position of ``optimizers``' states is (per optimizer,
    per group, in order): ``convert`` keys ``torch_optimizer_state``'s positional state by these names. Local."""
    names = parameter_names(module)
    recorded = [
        [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups] for optimizer in optimizers
    ]
    checkpoint[OWN_KEY] = {**checkpoint.get(OWN_KEY, {}), NAMES_KEY: recorded}


def recorded_optimizer_names(checkpoint: Mapping[str, Any], index: int) -> list[list[str]] | None:
    """The names of optimizer ``index``'s parameters, per group, in position order: ``record_optimizer_names``' entry,
    else its groups' ``param_names`` (``full_optimizer_state``, ``convert``, the Trainer's files before
    ``torch_optimizer_state``); None where the file records neither (ddp's, one device's)."""
    groups = checkpoint["optimizer_states"][index].get("param_groups", [])
    entry = checkpoint.get(OWN_KEY)
    recorded = entry.get(NAMES_KEY) if isinstance(entry, dict) else None
    if isinstance(recorded, list) and index < len(recorded):
        if [len(names) for names in recorded[index]] == [len(group["params"]) for group in groups]:
            return [list(names) for names in recorded[index]]
    if groups and all("param_names" in group for group in groups):
        return [list(group["param_names"]) for group in groups]
    return None


def check_full_optimizer_state(module: nn.Module, optimizer: Optimizer, saved: dict[str, Any], source: object) -> None:
    """Refuse a full (positional) optimizer state that does not fit ``optimizer``: grouping, type, state keys, shapes.

    Initialises the optimizer's state: call it inside ``optimizers_restored_on_error``.
    """
    names = parameter_names(module)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved_state = saved.get("state", {})
    beyond = sorted(int(index) for index in saved_state if not 0 <= int(index) < len(params))
    if beyond:
        raise ValueError(
            f"the checkpoint at {source} has optimizer state for parameter positions {beyond[:5]} but this optimizer "
            f"has {len(params)} parameters; resume with the configure_optimizers the checkpoint was trained with."
        )
    check_optimizer_fits(
        optimizer,
        saved.get("param_groups", []),
        {int(index): set(state) for index, state in saved_state.items()},
        [names.get(id(param), f"parameter {i}") for i, param in enumerate(params)],
        source,
    )
    for _, _, value, param, template in _entries(optimizer, saved):
        _per_row(value, param, template)  # raises on a shape mismatch


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, saved: dict[str, Any]) -> None:
    """Load a full (positional) optimizer state dict that ``check_full_optimizer_state`` accepted: every rank copies
    its rows of each per-row tensor into the optimizer's own state tensors, so the load allocates no second copy."""
    init_optimizer_state(optimizer)  # its own state tells per-row tensors from the rest, by shape
    state: dict[Any, dict[str, Any]] = {}
    for index, key, value, param, template in _entries(optimizer, saved):
        state.setdefault(index, {})[key] = local_rows(value, param, template)
    # ``param_names`` are the checkpoint's record for ``convert``. Torch would make them the live groups' names,
    # after which ``add_param_group`` refuses any group without names; an optimizer built with names keeps them.
    groups = [
        {key: value for key, value in saved_group.items() if key != "param_names" or "param_names" in group}
        for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _entries(optimizer: Optimizer, saved: dict[str, Any]) -> list[tuple[Any, str, Any, Tensor, Any]]:
    """(position, key, saved value, parameter, the optimizer's own value for that key) for every saved state entry of
    a parameter this rank holds elements of: a rank keeps no state for the others (held whole elsewhere, or rows
    that all lie on other ranks), as the optimizer, which never steps them here, keeps none."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return [
        (index, key, value, params[int(index)], optimizer.state.get(params[int(index)], {}).get(key))
        for index, param_state in saved.get("state", {}).items()
        if params[int(index)].numel() or fsdp_param_of(params[int(index)]) is None
        for key, value in param_state.items()
    ]


def local_rows(value: Any, param: Tensor, template: Any) -> Any:
    """This rank's rows of a full per-row tensor, copied into ``template`` (the optimizer's own tensor for the same
    key); any other value as it is."""
    fsdp_param = _per_row(value, param, template)
    if fsdp_param is None:
        return value
    return template.copy_(fsdp_param.layout.local_rows_of(value).reshape(template.shape))


def _per_row(value: Any, param: Tensor, template: Any) -> FSDPParam | None:
    """``param``'s ``FSDPParam`` if ``value`` is a full per-row tensor to slice (its shape checked), else None."""
    fsdp_param = fsdp_param_of(param)
    per_row = isinstance(template, Tensor) and template.dim() > 0 and template.shape == param.shape
    if fsdp_param is None or not per_row or not isinstance(value, Tensor):
        return None
    if tuple(value.shape) != tuple(fsdp_param.shape):
        raise ValueError(
            f"the checkpoint's optimizer state for '{fsdp_param.fqn}' has shape {tuple(value.shape)} but the "
            f"parameter has shape {tuple(fsdp_param.shape)}; load a checkpoint of the same model."
        )
    return fsdp_param
