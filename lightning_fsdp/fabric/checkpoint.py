"""``fabric.save`` / ``fabric.load``: a full file in Lightning Fabric's own layout, a sharded folder in the Trainer's.

Fabric hands a strategy a dictionary of named objects (``{"model": model, "optimizer": optimizer, "iter_num": 3}``).

- full: one file with the user's own keys, as Lightning's Fabric FSDP, ddp and a single device write it, and what our
  loaders need under one private key (``save_full``);
- sharded: the DCP folder with ``model`` and ``optimizer_0``, ``optimizer_1``, ... and ``meta.pt`` holding every
  other entry, the Trainer strategy's layout (see :mod:`lightning_fsdp.checkpoint`).

``fabric.load`` reads either, and the other layouts ``load_into`` lists. Every check -- keys, shapes, optimizers, the
requested entries -- comes before the first tensor changes, and the refusal and safety rules are the Trainer's:
destinations checked before anything is written, atomic writes, nothing unpickled beyond plain data unless trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.full import (
    FABRIC_KEY,
    OWN_KEY,
    VERSION_KEY,
    as_trainer_layout,
    check_full_optimizer_state,
    full_optimizer_state,
    load_full_optimizer_state,
    load_full_state,
    named_optimizer_state,
    positional_optimizer_state,
    save_full_checkpoint,
)
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.optimizer_check import optimizers_restored_on_error
from lightning_fsdp.checkpoint.remote import downloaded_once_per_host, load_meta_remote, remote_kind, save_full_remote
from lightning_fsdp.checkpoint.safe_load import load_torch_file
from lightning_fsdp.checkpoint.sharded import META_FILE, is_sharded_checkpoint, load_sharded, save_sharded
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.state.state_dict import (
    full_state_dict,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)

Filter = Mapping[str, Callable[[str, Any], bool]]
_RECORD = "fabric"  # under OWN_KEY: {"module": the module's name, "optimizers": the optimizers' names, in order}
# Which Lightning wrote the checkpoint, as in a Trainer's: a Trainer refuses a checkpoint without it.
_VERSION_KEY = VERSION_KEY
_LAYOUT_KEYS = ("state_dict", "optimizer_states", OWN_KEY, _VERSION_KEY, FABRIC_KEY)


@dataclass(frozen=True)
class FabricState:
    """A ``fabric.save``/``fabric.load`` state split into the sharded module, its optimizers and everything else."""

    module_key: str
    module: nn.Module
    optimizers: dict[str, Optimizer]
    others: dict[str, Any]


def split_state(state: Mapping[str, Any]) -> FabricState:
    """Find the one sharded module (refused: none, or several) and the optimizers; the rest is metadata."""
    sharded = [key for key, obj in state.items() if isinstance(obj, nn.Module) and unit_of(obj) is not None]
    if len(sharded) != 1:
        found = "no model set up by Fabric" if not sharded else f"{len(sharded)} sharded models ({sharded})"
        raise ValueError(
            f"the checkpoint state holds {found}; pass exactly one, set up with fabric.setup, as "
            "state={'model': model, 'optimizer': optimizer, ...} (save several models to several paths)."
        )
    optimizers = {key: obj for key, obj in state.items() if isinstance(obj, Optimizer)}
    others = {key: obj for key, obj in state.items() if key != sharded[0] and key not in optimizers}
    clash = sorted(set(others) & set(_LAYOUT_KEYS))
    if clash:
        raise ValueError(
            f"the checkpoint state uses the name {clash[0]!r}, which the checkpoint layout keeps for itself; rename "
            "that entry."
        )
    return FabricState(sharded[0], state[sharded[0]], optimizers, others)


def save_full(
    path: str | Path, parts: FabricState, filter: Filter, rank0: bool, storage_options: dict[str, Any] | None = None
) -> None:
    """Gather the module and optimizers (a collective) and, on rank 0, write one file atomically, in Fabric's layout:
    the user's keys hold the full state dicts, ``FABRIC_KEY`` the names our loaders need.

    ``ckpt["model"]`` is the model's full state dict (plain tensors: ``torch.load(path, weights_only=True)`` reads it
    and ``model.load_state_dict`` of the unsharded model takes it, LitGPT's ``ckpt.get("model", ckpt)`` too),
    ``ckpt["optimizer"]`` the optimizer's full state keyed by parameter name as Lightning's Fabric FSDP writes it
    (``Optimizer.load_state_dict`` of the unsharded model takes it as well), every other entry as given. What our
    loaders need -- which key is the module, which are the optimizers, the Lightning version -- lies under
    ``FABRIC_KEY`` (``"_lightning_fsdp"``), so a Trainer's ``ckpt_path=`` and ``lightning-fsdp convert`` read the file
    too.

    The caller has checked the destination on rank 0 and shared the verdict, so no rank gathers for a refused save.
    """
    _refuse_optimizer_filter(parts, filter)
    model = _filtered(parts.module_key, full_state_dict(parts.module), filter)
    optimizer_states = [full_optimizer_state(parts.module, optimizer) for optimizer in parts.optimizers.values()]
    if rank0:
        checkpoint = {
            **_metadata(parts, filter),
            parts.module_key: model,
            **{name: named_optimizer_state(s) for name, s in zip(parts.optimizers, optimizer_states, strict=True)},
            FABRIC_KEY: {
                "module": parts.module_key,
                "optimizers": list(parts.optimizers),
                "lightning_version": lightning.__version__,
            },
        }
        if is_remote(path):
            save_full_remote(str(path), checkpoint, storage_options)
        else:
            save_full_checkpoint(path, checkpoint)


def save_sharded_folder(
    path: str | Path, parts: FabricState, filter: Filter, storage_options: dict[str, Any] | None = None
) -> None:
    """Write the DCP folder and ``meta.pt`` atomically, every rank its own rows (a collective)."""
    save_sharded(path, *sharded_folder_state(parts, filter), storage_options)


def sharded_folder_state(parts: FabricState, filter: Filter) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a sharded folder holds: the DCP state (DTensors aliasing the shards) and ``meta.pt``'s contents."""
    _refuse_optimizer_filter(parts, filter)
    state: dict[str, Any] = {"model": _filtered(parts.module_key, sharded_state_dict(parts.module), filter)}
    for index, optimizer in enumerate(parts.optimizers.values()):
        state[f"optimizer_{index}"] = sharded_optimizer_state_dict(parts.module, optimizer)
    return state, {**_metadata(parts, filter), **_record(parts)}


def load_into(
    path: str | Path,
    parts: FabricState,
    strict: bool,
    trust: bool,
    opt_in: str,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a full file or a sharded folder into ``parts``; return the entries nobody asked for.

    The requested metadata entries are put into ``parts.others``' owner by the caller (see ``restore_metadata``).
    ``path`` may be an fsspec URL: a prefix is read range by range, an object downloaded once per host. Besides
    ``fabric.save``'s two forms it reads the full files of the older layout (the Trainer's keys ``state_dict`` /
    ``optimizer_states``, the names recorded under ``lightning_fsdp.fabric``), a Trainer's checkpoints, and a full
    file in Fabric's plain layout without our record (what ``Fabric(strategy="ddp")`` saves).
    """
    fabric_layout = False
    kind = _kind(path, storage_options)
    if kind == "sharded":
        if not is_sharded_checkpoint(path, storage_options):
            raise FileNotFoundError(f"{path} is a folder but not a sharded checkpoint (it has no .metadata file).")
        if is_remote(path):
            meta = load_meta_remote(str(path), trust, opt_in, storage_options)
        else:
            meta = load_torch_file(Path(path) / META_FILE, trust, opt_in)
        if not isinstance(meta, dict):
            raise ValueError(f"{path}'s {META_FILE} is not a checkpoint's meta.pt (it holds a {type(meta).__name__}).")
        optimizers = _in_saved_order(parts, _recorded_optimizers(meta), path)
        _check_requested(parts, meta, strict, path)
        remainder = load_sharded(path, parts.module, optimizers, strict, trust, opt_in, None, storage_options)
    elif kind == "full":
        checkpoint = _read_file(path, trust, opt_in, storage_options)
        if not isinstance(checkpoint, dict):
            raise ValueError(f"{path} is not a checkpoint: it holds a {type(checkpoint).__name__}, not a dict.")
        names = as_trainer_layout(checkpoint)  # a full file of fabric.save's layout
        fabric_layout = names is not None
        if not fabric_layout:
            names = _as_lightning_layout(checkpoint, parts, strict, path)
        optimizers = _in_saved_order(parts, names, path)
        _check_requested(parts, checkpoint, strict, path)
        remainder = load_full_state(checkpoint, path, parts.module, optimizers, strict)
    else:
        raise FileNotFoundError(f"no checkpoint at {path}; pass the file or sharded folder fabric.save wrote.")
    if fabric_layout or _recorded_optimizers(remainder) is not None:  # by fabric.save: its entries are no user's
        remainder.pop(_VERSION_KEY, None)
    remainder.pop(OWN_KEY, None)
    return remainder


def restore_metadata(remainder: dict[str, Any], parts: FabricState, state: dict[str, Any]) -> None:
    """Move each requested entry out of ``remainder`` into ``state``: into the object itself when it is stateful."""
    for key in parts.others:
        if key not in remainder:
            continue
        value = remainder.pop(key)
        if isinstance(state[key], _Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value


def _kind(path: str | Path, storage_options: dict[str, Any] | None) -> str | None:
    """``"sharded"`` (a folder, a prefix), ``"full"`` (a file, an object) or None (nothing there)."""
    if is_remote(path):
        return remote_kind(str(path), storage_options)
    path = Path(path)
    return "sharded" if path.is_dir() else "full" if path.is_file() else None


def _read_file(path: str | Path, trust: bool, opt_in: str, storage_options: dict[str, Any] | None = None) -> Any:
    """A full file's contents (plain data only unless ``trust``); an object downloaded once per host (collective)."""
    if not is_remote(path):
        return load_torch_file(path, trust, opt_in)
    with downloaded_once_per_host(str(path), storage_options) as local:
        return load_torch_file(local, trust, opt_in)


def load_raw_module(path: Path, module: nn.Module, strict: bool, trust: bool, opt_in: str) -> None:
    """A plain ``module.state_dict()`` file into the sharded ``module`` through ``module.load_state_dict``, as ddp
    loads it: the modules' own ``_load_from_state_dict`` (renamed keys) and load hooks run, every rank keeps its rows
    (see [Note: loading through the modules' own hooks] in ``engine/state/load_hooks.py``)."""
    module.load_state_dict(_raw_file(path, trust, opt_in), strict=strict)


def load_raw_optimizer(path: Path, module: nn.Module, optimizer: Optimizer, trust: bool, opt_in: str) -> None:
    """A plain ``optimizer.state_dict()`` file (full shapes: a ddp or one-device run's) into the sharded optimizer."""
    state = _raw_file(path, trust, opt_in)
    with optimizers_restored_on_error([optimizer]):
        check_full_optimizer_state(module, optimizer, state, path)
    load_full_optimizer_state(module, optimizer, state)


def _raw_file(path: str | Path, trust: bool, opt_in: str) -> dict[str, Any]:
    if _kind(path, None) == "sharded":
        raise ValueError(
            f"{path} is a sharded checkpoint folder; fabric.load_raw reads one state-dict file, so use "
            "fabric.load(path, {'model': model, ...}) for the folder."
        )
    state = _read_file(path, trust, opt_in)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict; save one with torch.save.")
    return state


def _as_lightning_layout(checkpoint: dict[str, Any], parts: FabricState, strict: bool, path: Path) -> list[str] | None:
    """Put a plain Fabric-layout file (module and optimizers under the user's names, no record of ours: a ddp or
    Lightning FSDP run's) into the Trainer's layout, in place.

    Returns the names of the saved optimizers in order, or None for a Trainer checkpoint (optimizers by position).
    """
    if "state_dict" in checkpoint:
        return _recorded_optimizers(checkpoint)
    if not isinstance(checkpoint.get(parts.module_key), Mapping):
        raise ValueError(
            f"{path} holds neither a Lightning checkpoint's 'state_dict' nor a state dict under {parts.module_key!r}; "
            "pass a checkpoint of this model, saved by fabric.save or a Trainer."
        )
    missing = [key for key in parts.optimizers if key not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint {path}."
            " To disable strict loading, set `strict=False`."
        )
    checkpoint["state_dict"] = checkpoint.pop(parts.module_key)
    names = [key for key in parts.optimizers if key in checkpoint]
    # Lightning's Fabric FSDP keys optimizer state by parameter name, ddp and one device by position.
    checkpoint["optimizer_states"] = [positional_optimizer_state(checkpoint.pop(key)) for key in names]
    return names


def _in_saved_order(parts: FabricState, saved: list[str] | None, path: Path) -> list[Optimizer]:
    """The state's optimizers in the order the checkpoint holds theirs: all of them, or none (a weights-only load)."""
    if saved is None or not parts.optimizers:
        return list(parts.optimizers.values())
    unknown = sorted(set(parts.optimizers) - set(saved))
    if unknown or len(parts.optimizers) != len(saved):
        raise ValueError(
            f"the checkpoint at {path} holds the optimizers {saved} but the state to load names "
            f"{sorted(parts.optimizers)}; pass all of them under those names, or none to load the model alone."
        )
    return [parts.optimizers[name] for name in saved]


def _recorded_optimizers(checkpoint: Mapping[str, Any]) -> list[str] | None:
    record = checkpoint.get(OWN_KEY)
    entry = record.get(_RECORD) if isinstance(record, dict) else None
    return list(entry["optimizers"]) if isinstance(entry, dict) else None


def _check_requested(parts: FabricState, saved: Mapping[str, Any], strict: bool, path: Path) -> None:
    """Fabric's rule for the other entries, checked before anything loads: under ``strict`` each must be saved."""
    missing = [key for key in parts.others if key not in saved]
    if strict and missing:
        raise KeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the loaded checkpoint {path}."
            " To disable strict loading, set `strict=False`."
        )


def _record(parts: FabricState) -> dict[str, Any]:
    """What fabric.save adds beside the user's entries: the names of module and optimizers, the Lightning version."""
    names = {"module": parts.module_key, "optimizers": list(parts.optimizers)}
    return {OWN_KEY: {_RECORD: names}, _VERSION_KEY: lightning.__version__}


def _metadata(parts: FabricState, filter: Filter) -> dict[str, Any]:
    """Every other entry as plain data: a stateful object (a scheduler, a plain module) by its ``state_dict()``."""
    metadata = {}
    for key, obj in parts.others.items():
        value = obj.state_dict() if isinstance(obj, _Stateful) else obj
        metadata[key] = _filtered(key, value, filter)
    return metadata


def _filtered(key: str, value: Any, filter: Filter) -> Any:
    """``value`` with only the items ``filter[key](name, item)`` keeps, as Fabric's ``save(filter=...)`` does."""
    if key not in filter or not isinstance(value, Mapping):
        return value
    return {name: item for name, item in value.items() if filter[key](name, item)}


def _refuse_optimizer_filter(parts: FabricState, filter: Filter) -> None:
    filtered = sorted(set(filter) & set(parts.optimizers))
    if filtered:
        raise ValueError(
            f"save(filter=...) names the optimizer {filtered[0]!r}; an optimizer's state is saved whole (its groups "
            "and per-parameter state must match to load), so filter the model's entries only."
        )
