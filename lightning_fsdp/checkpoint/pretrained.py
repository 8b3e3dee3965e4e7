"""Pretrained safetensors weights into a sharded model, each rank reading only its own rows.

The usual fine-tuning start -- ``from_pretrained`` on every rank, then shard -- holds the whole model in every rank's
host memory at once. A safetensors file can be read a slice at a time (``safe_open(...).get_slice(name)[a:b]``
reads just those bytes), and a sharded parameter needs only rows ``[start, start + local_rows)``, so
``load_pretrained`` on an already sharded model costs each rank about one tensor's rows beyond its shards. It reads
one file or a Hugging Face index of several (``model.safetensors.index.json``), maps names by a prefix, and checks
every key and shape before it copies anything.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from safetensors import safe_open
from torch import nn

from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.remote_safetensors import RemoteSafetensors
from lightning_fsdp.engine.runtime.registry import fsdp_param_of

__all__ = ["PretrainedLoad", "load_pretrained", "safetensors_files"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class PretrainedLoad:
    """What ``load_pretrained`` did: the module names it filled, and the file's tensors nothing took."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def safetensors_files(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tensor name -> the file holding it, for a ``.safetensors`` file, an index JSON, or a folder with either.

    At an fsspec URL the files are URLs too (read by byte ranges, see ``remote_safetensors.py``).
    """
    if is_remote(path):
        return _remote_safetensors_files(str(path).rstrip("/"), storage_options or {})
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            raise FileNotFoundError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass the weights' file.")
    if not path.is_file():
        raise FileNotFoundError(f"no pretrained weights at {path}.")
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not a safetensors index (no 'weight_map': {err}).") from None
        return {name: path.parent / file for name, file in weight_map.items()}
    try:
        with safe_open(path, framework="pt") as handle:
            return {name: path for name in handle.keys()}
    except Exception as err:  # safetensors raises its own SafetensorError for anything unreadable
        raise ValueError(f"{path} is not a safetensors file ({err}).") from None


def _remote_safetensors_files(url: str, storage_options: dict[str, Any]) -> dict[str, str]:
    fs, path = url_to_fs(url, **storage_options)
    if not url.endswith((".json", ".safetensors")):
        for name in (INDEX_FILE, SINGLE_FILE):
            if fs.isfile(f"{path}/{name}"):
                return _remote_safetensors_files(f"{url}/{name}", storage_options)
        raise FileNotFoundError(f"{url} holds neither {SINGLE_FILE} nor {INDEX_FILE}; pass the weights' file.")
    if not fs.isfile(path):
        raise FileNotFoundError(f"no pretrained weights at {url}.")
    if url.endswith(".json"):
        try:
            weight_map = json.loads(fs.cat_file(path))["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{url} is not a safetensors index (no 'weight_map': {err}).") from None
        folder = url.rsplit("/", 1)[0]
        return {name: f"{folder}/{file}" for name, file in weight_map.items()}
    return {name: url for name in RemoteSafetensors(url, storage_options).keys()}


def _open(file: Any, storage_options: dict[str, Any] | None) -> Any:
    """``safe_open`` of a local file, or its byte-range reading counterpart for a URL."""
    return RemoteSafetensors(file, storage_options) if is_remote(file) else safe_open(file, framework="pt")


def load_pretrained(
    module: nn.Module,
    path: str | os.PathLike,
    prefix: str = "",
    strict: bool = True,
    rename: Callable[[str], str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> PretrainedLoad:
    """Copy safetensors weights at ``path`` into ``module``'s parameters and persistent buffers, in place.

    A sharded parameter gets only this rank's rows, read straight from the file; anything else is read whole. Works
    on an unsharded module too (every rank then reads every tensor). ``prefix``: only the module's names that start
    with it are loaded, without it (``"model."`` for a LightningModule holding the Hugging Face model as
    ``self.model``); ``rename`` maps the remaining name to the file's, if they differ further. A parameter shared
    under several names (tied embeddings) is filled from whichever of its names the file has.

    ``path`` may be an fsspec URL (``s3://bucket/model``; ``storage_options`` for the store): each rank then
    fetches only the byte ranges of its rows.

    Raises (before anything is copied): ``ValueError`` naming missing and unexpected keys (``strict``) and shape
    mismatches; ``FileNotFoundError``.
    """
    sources = safetensors_files(path, storage_options)
    targets: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if name.startswith(prefix):
            targets.setdefault(id(tensor), (tensor, []))[1].append(name)
    key_of = {name: name[len(prefix) :] for _, names in targets.values() for name in names}
    if rename is not None:
        key_of = {name: rename(key) for name, key in key_of.items()}
    plan, missing = [], []
    for tensor, names in targets.values():
        found = [name for name in names if key_of[name] in sources]
        if not found:
            missing.extend(names)
            continue
        if tensor.is_meta:
            raise ValueError(
                f"'{names[0]}' is still on the meta device; load pretrained weights after the model is materialized "
                "and sharded (the strategy's setup does both)."
            )
        plan.append((tensor, found[0], key_of[found[0]]))
    unexpected = sorted(set(sources) - set(key_of.values()))
    _check_shapes(plan, sources, storage_options)
    problems = []
    if strict and missing:
        problems.append(f"missing keys {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if problems:
        raise ValueError(
            f"the weights at {path} do not fit this model: " + "; ".join(problems) + ". Check `prefix` (the part of "
            "the model's names the file lacks) or pass strict=False to load what matches."
        )
    with torch.no_grad():
        for tensor, _, key in plan:
            _copy_rows(tensor, sources[key], key, storage_options)
    return PretrainedLoad(sorted(name for _, name, _ in plan), sorted(missing), unexpected)


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    fsdp_param = fsdp_param_of(tensor)
    return tuple(fsdp_param.shape if fsdp_param is not None else tensor.shape)


def _check_shapes(
    plan: list[tuple[torch.Tensor, str, str]], sources: dict[str, Any], storage_options: dict[str, Any] | None
) -> None:
    wrong = []
    for tensor, name, key in plan:
        with _open(sources[key], storage_options) as handle:
            shape = tuple(handle.get_slice(key).get_shape())
        if shape != _full_shape(tensor):
            wrong.append(f"'{name}' has shape {shape} in the file but {_full_shape(tensor)} in the model")
    if wrong:
        raise ValueError("the pretrained weights do not fit this model: " + "; ".join(wrong[:6]) + ".")


def _copy_rows(target: torch.Tensor, file: Any, key: str, storage_options: dict[str, Any] | None) -> None:
    """Read ``key``'s rows this rank holds (all of them for a tensor that is not sharded) into ``target``."""
    fsdp_param = fsdp_param_of(target)
    with _open(file, storage_options) as handle:
        if fsdp_param is None or len(fsdp_param.shape) == 0:
            source = handle.get_tensor(key)
            if fsdp_param is not None:  # a 0-dim parameter: its one row lives on the shard group's first rank
                source = source.reshape(-1)[: target.numel()]
        else:
            source = handle.get_slice(key)[fsdp_param.layout.row_range]
        target.copy_(source.reshape(target.shape))
