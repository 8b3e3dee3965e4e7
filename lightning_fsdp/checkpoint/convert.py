"""``lightning-fsdp convert``: between the full file, the sharded folder and safetensors, offline.

One process, no process group, no model code: everything comes from the checkpoint itself. Tensors stream one at a
time where the output allows it (safetensors from either form: peak memory about the largest tensor); a full
``.ckpt`` is one ``torch.save`` of the whole model, so that direction holds it once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rich.progress import track
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from lightning_fsdp.checkpoint.atomic import atomic_directory, tensor_bytes, write_file_atomically
from lightning_fsdp.checkpoint.callback_tensors import SAVED_UNDER, fold_callback_tensors, merge_callback_tensors
from lightning_fsdp.checkpoint.destination import refusal_to_replace
from lightning_fsdp.checkpoint.full import (
    NAMES_KEY,
    OWN_KEY,
    as_trainer_layout,
    positional_optimizer_state,
    recorded_optimizer_names,
    save_full_checkpoint,
)
from lightning_fsdp.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, lightning_prefix, write_hf_folder
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote import staged_for_convert
from lightning_fsdp.checkpoint.safe_load import dcp_load_planner, dcp_reader, load_torch_file
from lightning_fsdp.checkpoint.safetensors_stream import write_safetensors
from lightning_fsdp.checkpoint.sharded import META_FILE, is_sharded_checkpoint, read_checked_metadata

FORMATS = ("full", "sharded", "safetensors", "hf")
_OPT_IN = "lightning-fsdp convert --trust-checkpoint"


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    strip_prefix: str = "",
    quiet: bool = False,
    trust: bool = False,
    overwrite: bool = False,
    config: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Convert the checkpoint at ``src`` into ``to`` at ``dst``; ``strip_prefix`` drops a name prefix (safetensors, hf).

    ``hf`` writes a folder transformers' ``from_pretrained`` reads (see ``hf_export.py``): the LightningModule's
    prefix stripped (unless ``strip_prefix`` says which), shards above ``max_shard_bytes``, ``config`` copied in.

    ``dst`` must not exist, unless ``overwrite`` and it is a checkpoint of the form ``to`` (which is then replaced
    atomically); nothing else is ever replaced. ``trust`` allows unpickling more than plain data from ``src``.

    ``src`` and ``dst`` may be fsspec URLs (``s3://bucket/ckpt``; ``storage_options`` for the store): the conversion
    then runs on local copies in a temporary folder (see ``remote.staged_for_convert``).
    """
    if to not in FORMATS:
        raise ValueError(f"--to {to!r} is not a format; use one of {', '.join(FORMATS)}.")
    if is_remote(src) or is_remote(dst):
        with staged_for_convert(src, dst, to, overwrite, trust, _OPT_IN, storage_options) as (local_src, local_dst):
            convert(local_src, local_dst, to, strip_prefix, quiet, trust, False, config, max_shard_bytes)
        return
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"no checkpoint at {src}.")
    if dst.exists() or dst.is_symlink():
        refusal = refusal_to_replace(dst, to) if overwrite else None
        if not overwrite:
            refusal = (
                f"{dst} already exists; pass --overwrite to replace a {to} checkpoint there, or choose another path."
            )
        if refusal is not None:
            raise FileExistsError(refusal)
    sharded = is_sharded_checkpoint(src)
    if src.is_dir() and not sharded:
        read_checked_metadata(src, trust, _OPT_IN)  # raises the message that says what is missing
    show = (lambda names: names) if quiet else (lambda names: track(names, description=f"writing {dst.name}"))
    if to == "safetensors":
        _to_safetensors(src, dst, sharded, strip_prefix, show, trust)
    elif to == "hf":
        _to_hf(src, dst, sharded, strip_prefix, show, trust, config, max_shard_bytes)
    elif to == "full":
        checkpoint = _read_sharded(src, trust) if sharded else _read_full(src, trust)
        save_full_checkpoint(dst, checkpoint)
    else:
        if sharded:
            raise ValueError(f"{src} is already a sharded checkpoint; copy the folder, or convert it --to full.")
        _full_to_sharded(_read_full(src, trust), src, dst)


def _read_full(src: Path, trust: bool) -> Any:
    """A full file, with the callback tensors of one Lightning consolidated from a sharded folder in our place."""
    checkpoint = load_torch_file(src, trust, _OPT_IN)
    fold_callback_tensors(checkpoint)
    return checkpoint


def _to_safetensors(src: Path, dst: Path, sharded: bool, strip_prefix: str, show: Any, trust: bool) -> None:
    sources, load = model_tensors(src, sharded, trust)
    renamed = {(n[len(strip_prefix) :] if strip_prefix and n.startswith(strip_prefix) else n): n for n in sources}
    specs = [(new, *sources[old]) for new, old in renamed.items()]
    write_file_atomically(
        dst,
        lambda tmp: write_safetensors(tmp, specs, lambda new: load(renamed[new]), show),
        form="safetensors",
        expected_bytes=sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in specs),
    )


def _to_hf(
    src: Path,
    dst: Path,
    sharded: bool,
    strip_prefix: str,
    show: Any,
    trust: bool,
    config: str | os.PathLike | None,
    max_shard_bytes: int,
) -> None:
    if config is not None and not Path(config).is_file():
        raise FileNotFoundError(f"--config {config} is not a file; pass the model's config.json.")
    sources, load = model_tensors(src, sharded, trust)
    prefix = strip_prefix or lightning_prefix(sources)
    renamed = {(n[len(prefix) :] if prefix and n.startswith(prefix) else n): n for n in sources}
    specs = [(new, *sources[old]) for new, old in renamed.items()]
    config_path = Path(config) if config is not None else None
    write_hf_folder(dst, specs, lambda new: load(renamed[new]), config_path, max_shard_bytes, show)


TensorSpec = tuple[torch.dtype, tuple[int, ...]]


def model_tensors(src: Path, sharded: bool, trust: bool) -> tuple[dict[str, TensorSpec], Callable[[str], torch.Tensor]]:
    """The model's tensors in the checkpoint at ``src``: name -> (dtype, shape), and a function reading one of them.

    From a sharded folder each read loads just that tensor; a full file is memory-mapped. Either way one tensor at a
    time is in memory.
    """
    if not sharded:
        state = _state_dict_of(load_torch_file(src, trust, _OPT_IN), src)
        return {name: (t.dtype, tuple(t.shape)) for name, t in state.items()}, state.__getitem__
    reader = dcp_reader(src, trust, _OPT_IN)
    items = read_checked_metadata(src, trust, _OPT_IN).state_dict_metadata
    sources = {
        key[len("model.") :]: (item.properties.dtype, tuple(item.size))
        for key, item in items.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }

    def load(name: str) -> torch.Tensor:
        dtype, shape = sources[name]
        tensor = torch.empty(shape, dtype=dtype)
        planner = dcp_load_planner(trust, _OPT_IN)
        dcp.load({f"model.{name}": tensor}, storage_reader=reader, planner=planner, no_dist=True)
        return tensor

    return sources, load


def _state_dict_of(checkpoint: Any, src: Path) -> dict[str, torch.Tensor]:
    as_trainer_layout(checkpoint)  # a fabric.save file: its module under the user's key
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{src} is not a Lightning checkpoint: it has no 'state_dict'.")
    return checkpoint["state_dict"]


def _read_sharded(src: Path, trust: bool) -> dict[str, Any]:
    """A sharded folder as a Lightning checkpoint dict: ``state_dict``, ``optimizer_states`` and ``meta.pt``."""
    metadata = read_checked_metadata(src, trust, _OPT_IN)
    checkpoint = load_torch_file(src / META_FILE, trust, _OPT_IN)
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            flat[key] = None
    dcp.load(
        flat,
        storage_reader=dcp_reader(src, trust, _OPT_IN),
        planner=dcp_load_planner(trust, _OPT_IN),
        no_dist=True,
    )
    nested = _unflatten(flat, metadata.planner_data)
    checkpoint["state_dict"] = nested["model"]
    count = len([key for key in nested if key.startswith("optimizer_")])
    checkpoint["optimizer_states"] = [positional_optimizer_state(nested[f"optimizer_{i}"]) for i in range(count)]
    for key in SAVED_UNDER:  # full tensors, as a full save writes them
        merge_callback_tensors(checkpoint, nested.get(key, {}))
    return checkpoint


def _unflatten(flat: dict[str, Any], paths: dict[str, tuple]) -> dict[str, Any]:
    """DCP's flat keys back into nested dicts and lists, by the paths its metadata records for each key."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths[key]
        node: Any = nested
        for part, following in zip(path[:-1], path[1:], strict=True):
            empty: Any = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                node[part] = node[part] if node[part] is not None else empty
                node = node[part]
            else:
                node = node.setdefault(part, empty)
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = value
    return nested


def _full_to_sharded(checkpoint: dict[str, Any], src: Path, dst: Path) -> None:
    """A full checkpoint as a sharded folder any world size can load (written by this one process)."""
    state: dict[str, Any] = {"model": dict(_state_dict_of(checkpoint, src))}
    del checkpoint["state_dict"]
    for index, optimizer_state in enumerate(checkpoint.get("optimizer_states", [])):
        by_group = recorded_optimizer_names(checkpoint, index)
        if by_group is None:
            raise ValueError(
                "this checkpoint's optimizer state does not record parameter names (it was not written by "
                "lightning_fsdp), so it cannot be keyed by name; resume it with the strategy that wrote it."
            )
        names = [name for group_names in by_group for name in group_names]
        state[f"optimizer_{index}"] = {
            "state": {names[int(i)]: dict(s) for i, s in optimizer_state["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k not in ("params", "param_names")}, "params": group_names}
                for g, group_names in zip(optimizer_state["param_groups"], by_group, strict=True)
            ],
        }
    checkpoint.pop("optimizer_states", None)
    if isinstance(checkpoint.get(OWN_KEY), dict):  # the folder keys its state by name: no record to keep
        checkpoint[OWN_KEY].pop(NAMES_KEY, None)
        if not checkpoint[OWN_KEY]:
            del checkpoint[OWN_KEY]
    with atomic_directory(dst, expected_bytes=tensor_bytes(state), collective=False) as tmp:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        torch.save(checkpoint, tmp / META_FILE)
