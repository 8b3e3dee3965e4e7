"""The sharded form: a ``torch.distributed.checkpoint`` folder plus ``meta.pt``, saved and loaded by every rank.

The model's and the optimizers' sharded state dicts alias the live shards (see ``engine/state/state_dict.py``), so a
save copies nothing and a load writes every rank's rows straight into place, resharding from any world size. Before
anything is loaded the whole folder is checked against the model -- ``meta.pt`` read, every file the metadata names
present, long enough and holding a record where the metadata says (so another checkpoint's ``.distcp`` files are
caught), the keys and shapes, the number of optimizers and each one's state keys -- and a refusal names what is
wrong while the model and optimizers are as they were. Nothing is unpickled beyond plain data unless the caller
trusts the folder (see ``safe_load.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import StorageReader
from torch.optim import Optimizer

from lightning_fsdp.checkpoint.atomic import atomic_directory, tensor_bytes
from lightning_fsdp.checkpoint.callback_tensors import merge_callback_tensors, recorded_callback_tensors
from lightning_fsdp.checkpoint.full import check_no_unexpected, is_trainable_only
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.optimizer_check import check_optimizer_fits, optimizers_restored_on_error
from lightning_fsdp.checkpoint.remote import (
    is_sharded_remote,
    load_meta_remote,
    read_checked_metadata_remote,
    save_sharded_remote,
)
from lightning_fsdp.checkpoint.safe_load import dcp_load_planner, dcp_reader, load_torch_file, read_dcp_metadata
from lightning_fsdp.engine.optimizers import prepare_optimizer
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import (
    apply_optimizer_hyperparameters,
    parameter_names,
    sharded_optimizer_state_dict,
    sharded_state_dict,
    write_back_scalars,
)

META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"


def is_sharded_checkpoint(path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> bool:
    """A complete sharded checkpoint: a folder (or, at a URL, a prefix) holding DCP's ``.metadata``."""
    if is_remote(path):
        return is_sharded_remote(path, storage_options)
    return Path(path).is_dir() and (Path(path) / DCP_METADATA_FILE).is_file()


def sharded_checkpoint_state(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """``{"model": ..., "optimizer_0": ..., ...}`` in the sharded form: DTensors aliasing the live state."""
    state: dict[str, Any] = {"model": sharded_state_dict(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = sharded_optimizer_state_dict(module, optimizer)
    return state


def save_sharded(
    path: str | os.PathLike,
    state: dict[str, Any],
    meta: dict[str, Any] | bytes,
    storage_options: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write the folder atomically: ``state`` (see ``sharded_checkpoint_state``) in DCP format, ``meta.pt``.

    ``path`` is this rank's own: ranks that share no disk each publish their shards into theirs, with rank 0's
    ``.metadata`` and ``meta.pt`` copied beside them (see [Note: ranks that share no disk] in ``atomic.py``). At an
    fsspec URL every rank writes straight to the store, the completion mark last (see ``remote.py``). ``meta`` may
    come already serialised (``torch.save``'s bytes: a background save's snapshot). ``group``: the process group
    of every collective of the save, DCP's included (the default group when None; a background save's own).
    """
    if is_remote(path):
        save_sharded_remote(path, state, meta, storage_options)
        return
    rank0_files = (DCP_METADATA_FILE, META_FILE)
    with atomic_directory(path, expected_bytes=tensor_bytes(state), rank0_files=rank0_files, group=group) as tmp:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=group)
        if not dist.is_initialized() or dist.get_rank() == 0:
            if isinstance(meta, bytes):
                (tmp / META_FILE).write_bytes(meta)
            else:
                torch.save(meta, tmp / META_FILE)


def load_sharded(
    path: str | os.PathLike,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
    trust: bool = False,
    opt_in: str = "trust=True",
    callback_tensors: Mapping[str, dict[str, Tensor]] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load model and optimizer states into place after checking the whole folder; returns ``meta.pt``'s contents.

    ``trust`` allows unpickling more than plain data (``opt_in`` is how the caller's user says so, for messages).
    ``callback_tensors``: callbacks' per-rank tensors to load in place, by state key (see ``callback_tensors.py``);
    those the folder records come back inside the returned callback states. ``path`` may be an fsspec URL (each
    rank then reads only its byte ranges; ``storage_options`` as fsspec takes them).
    """
    for optimizer in optimizers:  # the layout its state is saved for decides where the model's shards live
        prepare_optimizer(optimizer)
    if is_remote(path):
        metadata = read_checked_metadata_remote(path, trust, opt_in, storage_options)
        meta = load_meta_remote(path, trust, opt_in, storage_options)
    else:
        path = Path(path)
        metadata = read_checked_metadata(path, trust, opt_in)
        meta = load_torch_file(path / META_FILE, trust, opt_in)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}'s {META_FILE} is not a checkpoint's meta.pt (it holds a {type(meta).__name__}).")
    if is_trainable_only(meta):
        saved = {key[len("model.") :] for key in metadata.state_dict_metadata if key.startswith("model.")}
        check_no_unexpected(set(module.state_dict(keep_vars=True)), saved, path)
        strict = False
    check_model_keys(metadata, module, strict)
    reader = partial(dcp_reader, path, trust, opt_in, storage_options)
    saved_optimizers = sorted(
        {key.split(".")[0] for key in metadata.state_dict_metadata if key.startswith("optimizer_")}
    )
    if optimizers and len(saved_optimizers) != len(optimizers):
        raise ValueError(
            f"the checkpoint at {path} holds {len(saved_optimizers)} optimizer state(s) but the model has "
            f"{len(optimizers)} optimizer(s); resume with the configure_optimizers the checkpoint was trained with."
        )
    target: dict[str, Any] = {"model": sharded_state_dict(module)}
    recorded = recorded_callback_tensors(metadata, callback_tensors or {}, path)
    target.update(recorded)
    if not strict:
        target["model"] = {k: v for k, v in target["model"].items() if f"model.{k}" in metadata.state_dict_metadata}
    with optimizers_restored_on_error(optimizers):
        for index, optimizer in enumerate(optimizers):
            _check_optimizer_names(metadata, index, module)
            names = [parameter_names(module)[id(p)] for group in optimizer.param_groups for p in group["params"]]
            saved_keys = _saved_state_keys(metadata, index)
            saved_groups = _saved_param_groups(reader, metadata, index, trust, opt_in)
            positional_keys = {i: saved_keys[name] for i, name in enumerate(names) if name in saved_keys}
            check_optimizer_fits(optimizer, saved_groups, positional_keys, names, path)
            target[f"optimizer_{index}"] = _recorded_hyperparameters_only(
                sharded_optimizer_state_dict(module, optimizer), metadata, index
            )
    dcp.load(target, storage_reader=reader(), planner=dcp_load_planner(trust, opt_in))
    write_back_scalars(module, target["model"])
    for index, optimizer in enumerate(optimizers):
        apply_optimizer_hyperparameters(optimizer, target[f"optimizer_{index}"]["param_groups"])
    for callbacks in recorded.values():
        merge_callback_tensors(meta, callbacks)
    return meta


def read_checked_metadata(path: Path, trust: bool = False, opt_in: str = "trust=True") -> Metadata:
    """The folder's DCP metadata, after checking that every record it names is there, whole and where it says."""
    if not path.is_dir():
        raise FileNotFoundError(f"no sharded checkpoint folder at {path}; pass the folder a sharded save wrote.")
    for required in (DCP_METADATA_FILE, META_FILE):
        if not (path / required).is_file():
            raise ValueError(
                f"the sharded checkpoint at {path} is incomplete: {required} is missing (an interrupted or partial "
                "copy?); resume from another checkpoint."
            )
    metadata = read_dcp_metadata(path, trust, opt_in)
    by_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        by_file.setdefault(info.relative_path, []).append(info)
    for relative, infos in sorted(by_file.items()):
        file = path / relative
        if not file.is_file():
            raise ValueError(f"the sharded checkpoint at {path} is incomplete: shard file {relative} is missing.")
        size = max(info.offset + info.length for info in infos)
        if file.stat().st_size < size:
            raise ValueError(
                f"the sharded checkpoint at {path} is truncated: {relative} has {file.stat().st_size} bytes of the "
                f"{size} its metadata records; resume from another checkpoint."
            )
        # Compressed records (a storage transform) have no fixed framing to check.
        spans = [(info.offset, info.length) for info in infos if not getattr(info, "transform_descriptors", None)]
        _check_record_framing(file, spans, path)
    return metadata


# Every record of a DCP shard file is one ``torch.save`` archive (a zip): it starts with a local file header and ends
# with the end-of-central-directory record. Checking both for every record the metadata lists costs two small reads
# per record and catches shard files that belong to another checkpoint before a byte of them is loaded.
_ZIP_START, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22


def _check_record_framing(file: Path, spans: list[tuple[int, int]], folder: Path) -> None:
    with open(file, "rb") as handle:
        for offset, length in sorted(spans):
            handle.seek(offset)
            start = handle.read(4)
            handle.seek(offset + length - _ZIP_END_SIZE)
            end = handle.read(4)
            if start != _ZIP_START or end != _ZIP_END:
                raise ValueError(
                    f"the sharded checkpoint at {folder} does not fit together: {file.name} holds no record at byte "
                    f"{offset} where its .metadata says one is (shard files of another checkpoint?); resume from "
                    "another checkpoint."
                )


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


def _saved_state_keys(metadata: Metadata, index: int) -> dict[str, set[str]]:
    """Per parameter name, the optimizer state keys optimizer ``index`` recorded (``exp_avg``, ``step``, ...)."""
    prefix = f"optimizer_{index}.state."
    keys: dict[str, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            name, state_key = key[len(prefix) :].rsplit(".", 1)
            keys.setdefault(name, set()).add(state_key)
    return keys


def _saved_param_groups(
    reader: Callable[[], StorageReader], metadata: Metadata, index: int, trust: bool, opt_in: str
) -> list[dict[str, Any]]:
    """Optimizer ``index``'s parameter groups as recorded: hyperparameter names (values not read) and ``params``.

    The parameter names of a group are one pickled list, not visible in the metadata: read just those (a collective).
    """
    prefix = f"optimizer_{index}.param_groups."
    groups: dict[int, dict[str, Any]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            number, name = key[len(prefix) :].split(".", 1)
            groups.setdefault(int(number), {})[name.split(".")[0]] = None
    params = {
        f"{prefix}{number}.params": None
        for number in groups
        if isinstance(metadata.state_dict_metadata.get(f"{prefix}{number}.params"), BytesStorageMetadata)
    }
    if params:
        dcp.load(params, storage_reader=reader(), planner=dcp_load_planner(trust, opt_in))
    for key, names in params.items():
        groups[int(key[len(prefix) :].split(".")[0])]["params"] = list(names or [])
    for group in groups.values():
        group.setdefault("params", [])
    return [groups[number] for number in sorted(groups)]
