"""The sharded form: a ``torch.distributed.checkpoint`` folder plus ``meta.pt``, saved and loaded by every rank.

The model's and the optimizers' sharded state dicts alias the live shards (see ``engine/state_dict.py``), so a save
copies nothing and a load writes every rank's rows straight into place, resharding from any world size. Before
anything is loaded the folder is checked against the model: missing or truncated files, other keys or shapes, a
different number of optimizers -- each refused with one sentence that names it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.atomic import atomic_directory
from lightning_fsdp.engine.registry import fsdp_param_of
from lightning_fsdp.engine.state_dict import (
    apply_optimizer_hyperparameters,
    init_optimizer_state,
    parameter_names,
    sharded_optimizer_state_dict,
    sharded_state_dict,
)

META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / DCP_METADATA_FILE).is_file()


def sharded_checkpoint_state(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """``{"model": ..., "optimizer_0": ..., ...}`` in the sharded form: DTensors aliasing the live state."""
    state: dict[str, Any] = {"model": sharded_state_dict(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = sharded_optimizer_state_dict(module, optimizer)
    return state


def save_sharded(path: str | os.PathLike, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write the folder atomically: ``state`` (see ``sharded_checkpoint_state``) in DCP format, ``meta.pt``."""
    with atomic_directory(path) as tmp:
        dcp.save(state, checkpoint_id=tmp)
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save(meta, tmp / META_FILE)


def load_sharded(
    path: str | os.PathLike, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool = True
) -> dict[str, Any]:
    """Load model and optimizer states into place after checking the folder; returns ``meta.pt``'s contents."""
    path = Path(path)
    metadata = read_checked_metadata(path)
    check_model_keys(metadata, module, strict)
    saved_optimizers = sorted(
        {key.split(".")[0] for key in metadata.state_dict_metadata if key.startswith("optimizer_")}
    )
    if optimizers and len(saved_optimizers) != len(optimizers):
        raise ValueError(
            f"the checkpoint at {path} holds {len(saved_optimizers)} optimizer state(s) but the model has "
            f"{len(optimizers)} optimizer(s); resume with the configure_optimizers the checkpoint was trained with."
        )
    target: dict[str, Any] = {"model": sharded_state_dict(module)}
    if not strict:
        target["model"] = {k: v for k, v in target["model"].items() if f"model.{k}" in metadata.state_dict_metadata}
    for index, optimizer in enumerate(optimizers):
        init_optimizer_state(optimizer)
        target[f"optimizer_{index}"] = _recorded_hyperparameters_only(
            sharded_optimizer_state_dict(module, optimizer), metadata, index
        )
        _check_optimizer_names(metadata, index, module)
    dcp.load(target, checkpoint_id=path)
    for index, optimizer in enumerate(optimizers):
        apply_optimizer_hyperparameters(optimizer, target[f"optimizer_{index}"]["param_groups"])
    return torch.load(path / META_FILE, map_location="cpu", weights_only=False)


def read_checked_metadata(path: Path) -> Metadata:
    """The folder's DCP metadata, after checking that every file it names is there and long enough."""
    if not path.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint folder at {path}; pass the folder a sharded save wrote.")
    for required in (DCP_METADATA_FILE, META_FILE):
        if not (path / required).is_file():
            raise ValueError(
                f"the sharded checkpoint at {path} is incomplete: {required} is missing (an interrupted or partial "
                "copy?); resume from another checkpoint."
            )
    metadata = FileSystemReader(path).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise ValueError(f"the sharded checkpoint at {path} is incomplete: shard file {relative} is missing.")
        if file.stat().st_size < size:
            raise ValueError(
                f"the sharded checkpoint at {path} is truncated: {relative} has {file.stat().st_size} bytes of the "
                f"{size} its metadata records; resume from another checkpoint."
            )
    return metadata


def check_model_keys(metadata: Metadata, module: nn.Module, strict: bool) -> None:
    saved = {
        key[len("model.") :]: tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    expected = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        fsdp_param = fsdp_param_of(tensor)
        expected[name] = tuple(fsdp_param.shape if fsdp_param is not None else tensor.shape)
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    problems = []
    if strict and missing:
        problems.append(f"missing keys {missing[:8]}")
    if strict and unexpected:
        problems.append(f"unexpected keys {unexpected[:8]}")
    problems += [
        f"'{name}' has shape {saved[name]} in the checkpoint but {expected[name]} in the model"
        for name in sorted(set(saved) & set(expected))
        if saved[name] != expected[name]
    ]
    if problems:
        raise ValueError(
            "the checkpoint does not match this model: " + "; ".join(problems[:6]) + ". Load a checkpoint of the "
            "same model architecture."
        )


def _recorded_hyperparameters_only(state: dict[str, Any], metadata: Metadata, index: int) -> dict[str, Any]:
    """``state`` without the group entries the checkpoint does not record, which then keep the optimizer's values.

    DCP refuses a load whose target has a key the checkpoint lacks, and a group can gain entries the saving run did
    not have: ``param_names`` (an optimizer built from ``named_parameters``) or a default a newer torch added.
    """
    for number, group in enumerate(state["param_groups"]):
        prefix = f"optimizer_{index}.param_groups.{number}."
        recorded = {key[len(prefix) :].split(".")[0] for key in metadata.state_dict_metadata if key.startswith(prefix)}
        for key in [key for key in group if key != "params" and key not in recorded]:
            del group[key]
    return state


def _check_optimizer_names(metadata: Metadata, index: int, module: nn.Module) -> None:
    prefix = f"optimizer_{index}.state."
    names = set(parameter_names(module).values())
    unknown = sorted(
        {key[len(prefix) :].rsplit(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith(prefix)} - names
    )
    if unknown:
        raise ValueError(
            f"optimizer {index} in the checkpoint has state for parameters this model does not have ({unknown[:5]}); "
            "load a checkpoint of the same model."
        )
