"""Checkpoints at fsspec URLs (``s3://bucket/ckpts/last.ckpt``, ``gs://``, ``az://``, ...): both forms, every rule kept.

An object store has no rename, so the local recipe (write a temporary, rename it into place, see ``atomic.py``) does
not carry over. What a store does give: an object appears only when its upload is complete (one PUT, or a multipart
upload that is committed at the end). So a full checkpoint is one upload, aborted if the write fails
(``save_full_remote``), and a sharded one is complete once DCP's ``.metadata``, written last, is there
(``save_sharded_remote``): a prefix without it is refused as torn. Nothing but our own checkpoint objects is ever
overwritten or deleted (``remote_refusal``). A full file is downloaded once per host (``downloaded_once_per_host``);
a sharded load reads only the byte ranges of this rank's rows (``FsspecReader``).

``storage_options`` (an endpoint, credentials) go to fsspec's ``url_to_fs`` unchanged; fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec``) and the store's client configuration (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ... for s3fs) apply as well.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata

from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.safe_load import dcp_reader, load_torch_bytes

__all__ = [
    "remote_refusal",
    "save_full_remote",
    "save_sharded_remote",
    "read_checked_metadata_remote",
    "load_meta_remote",
    "downloaded_once_per_host",
    "remote_kind",
    "completed_at",
    "is_sharded_remote",
    "remove_remote",
    "staged_for_convert",
]

META_FILE = "meta.pt"
DCP_METADATA_FILE = ".metadata"
# The objects a sharded save writes: DCP's shards and metadata (and the ``.metadata.tmp`` it renames), meta.pt.
_SHARDED_OBJECTS = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|meta\.pt)$")
_ADVICE = "choose another path, or remove it yourself if it should go."

StorageOptions = dict[str, Any] | None


def _store(url: str, storage_options: StorageOptions) -> tuple[AbstractFileSystem, str]:
    fs, path = url_to_fs(url, **(storage_options or {}))
    fs.invalidate_cache()  # another rank or process may have written since this process last listed
    return fs, path.rstrip("/")


def _objects_under(fs: AbstractFileSystem, path: str) -> dict[str, int]:
    """Relative name -> size of every object under the prefix ``path`` (none for a missing prefix)."""
    found = fs.find(path + "/", detail=True)  # a store's find of an object's own key returns that object
    prefix = path + "/"
    return {name[len(prefix) :]: int(info.get("size") or 0) for name, info in found.items() if name.startswith(prefix)}


def remote_kind(url: str, storage_options: StorageOptions = None) -> str | None:
    """``"full"`` for an object at ``url``, ``"sharded"`` for objects under it (complete or not), None for nothing."""
    fs, path = _store(url, storage_options)
    if fs.isfile(path):
        return "full"
    return "sharded" if _objects_under(fs, path) else None


def completed_at(url: str, storage_options: StorageOptions = None) -> float | None:
    """When the checkpoint at ``url`` was completed (a POSIX time): the object's, or for a sharded prefix its
    ``.metadata``'s modification time; None when there is no complete checkpoint there."""
    fs, path = _store(url, storage_options)
    if fs.isfile(path):
        return fs.modified(path).timestamp()
    mark = f"{path}/{DCP_METADATA_FILE}"
    return fs.modified(mark).timestamp() if fs.isfile(mark) else None


def is_sharded_remote(url: str, storage_options: StorageOptions = None) -> bool:
    """A complete sharded checkpoint under ``url``: its completion mark, DCP's ``.metadata``, is there."""
    fs, path = _store(url, storage_options)
    return DCP_METADATA_FILE in _objects_under(fs, path)


def remote_refusal(url: str, form: str, storage_options: StorageOptions = None) -> str | None:
    """Why a ``form`` (``"full"`` or ``"sharded"``) checkpoint must not be written at ``url`` (a sentence), or None.

    Nothing but our own checkpoint objects is ever overwritten or deleted: a destination holding anything else (a
    user's object at the key, foreign objects under the prefix) is refused before a byte is written, as locally.
    """
    fs, path = _store(url, storage_options)
    is_file, objects = fs.isfile(path), _objects_under(fs, path)
    if form == "sharded":
        if is_file:
            return f"{url} is an object; a sharded checkpoint is a prefix of objects and will not replace it: {_ADVICE}"
        foreign = sorted(name for name in objects if not _SHARDED_OBJECTS.match(name))
        if foreign:
            return (
                f"{url} holds objects that are not part of a sharded checkpoint "
                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), which a save would delete: {_ADVICE}"
            )
        return None
    if objects:
        return (
            f"{url} is a prefix holding objects; a full checkpoint is one object and will not replace them: {_ADVICE}"
        )
    if is_file and not _is_torch_archive(fs, path):
        return f"{url} exists and is not a checkpoint (not a torch.save archive), which a save would delete: {_ADVICE}"
    return None


def _is_torch_archive(fs: AbstractFileSystem, path: str) -> bool:
    with fs.open(path, "rb") as handle:
        try:
            return zipfile.is_zipfile(handle)
        except ValueError:  # fsspec's seek refuses to go before the start of an object shorter than a zip's end
            return False


def _write_object(fs: AbstractFileSystem, path: str, write: Callable[[IO[bytes]], None]) -> None:
    """``write`` into one upload to ``path``, committed only if it returns: a failed write leaves no object."""
    handle = fs.open(path, "wb")
    try:
        write(handle)
    except BaseException:
        handle.discard()  # aborts a multipart upload; a small buffered one is simply never sent
        handle.closed = True
        raise
    handle.close()


def save_full_remote(url: str, checkpoint: dict[str, Any], storage_options: StorageOptions = None) -> None:
    """Write ``checkpoint`` as one object at ``url``, streamed by ``torch.save`` (one process; checked first)."""
    refusal = remote_refusal(url, "full", storage_options)
    if refusal is not None:
        raise FileExistsError(refusal)
    fs, path = _store(url, storage_options)
    _write_object(fs, path, lambda handle: torch.save(checkpoint, handle))


def save_sharded_remote(
    url: str, state: dict[str, Any], meta: dict[str, Any], storage_options: StorageOptions = None
) -> None:
    """Write a sharded checkpoint under ``url``: every rank its own shard, ``.metadata`` last (a collective).

    Rank 0 checks the destination, removes a previous checkpoint there (its ``.metadata`` first) and writes
    ``meta.pt``; every rank learns the outcome before it writes. DCP then writes each rank's shard and, once all
    are in, ``.metadata``; a rank that fails makes DCP raise on every rank, and the prefix stays torn (refused).
    ``.metadata`` is the mark of a complete checkpoint and goes first when one is replaced, so a save that dies
    half-way leaves a torn prefix, never a mix of two checkpoints that loads. Nothing is staged on one node: every
    rank writes its own shard straight to the store through torch's ``FsspecWriter``.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    outcome: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            refusal = remote_refusal(url, "sharded", storage_options)
            if refusal is None:
                fs, path = _store(url, storage_options)
                _remove_sharded(fs, path)
                _write_object(fs, f"{path}/{META_FILE}", lambda handle: torch.save(meta, handle))
            outcome = [refusal]
        except Exception as err:
            failure = err
            outcome = [f"the sharded save to {url} failed on rank 0 ({err}); nothing was saved."]
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise (FileExistsError if "failed on rank 0" not in outcome[0] else RuntimeError)(outcome[0])
    writer = FsspecWriter(url, sync_files=False, **(storage_options or {}))
    dcp.save(state, storage_writer=writer)


def _remove_sharded(fs: AbstractFileSystem, path: str) -> None:
    """Delete a sharded checkpoint's objects (all ours: checked by the caller), the completion mark first."""
    objects = _objects_under(fs, path)
    marks = [name for name in objects if name.endswith(DCP_METADATA_FILE)]
    for name in marks:
        fs.rm_file(f"{path}/{name}")
    rest = [f"{path}/{name}" for name in objects if name not in marks]
    if rest:
        fs.rm(rest)


def remove_remote(url: str, storage_options: StorageOptions = None) -> str | None:
    """Delete our checkpoint at ``url`` (an object or a sharded prefix); None when done or nothing was there, else
    the sentence saying why it was left (it is not a checkpoint of ours)."""
    kind = remote_kind(url, storage_options)
    if kind is None:
        return None
    refusal = remote_refusal(url, kind, storage_options)
    if refusal is not None:
        return refusal.replace("which a save would delete", "which removing the checkpoint would delete")
    fs, path = _store(url, storage_options)
    if kind == "full":
        fs.rm_file(path)
    else:
        _remove_sharded(fs, path)
    return None


def read_checked_metadata_remote(
    url: str, trust: bool = False, opt_in: str = "trust=True", storage_options: StorageOptions = None
) -> Metadata:
    """``sharded.read_checked_metadata`` for a prefix in a store: ``.metadata`` and ``meta.pt`` present (else torn),
    every shard object the metadata names present, long enough and holding a record where the metadata says one is
    (two 4-byte ranges a record, fetched together)."""
    fs, path = _store(url, storage_options)
    objects = _objects_under(fs, path)
    if not objects:
        raise FileNotFoundError(f"no sharded checkpoint at {url}; pass the prefix a sharded save wrote.")
    for required in (DCP_METADATA_FILE, META_FILE):
        if required not in objects:
            raise ValueError(
                f"the sharded checkpoint at {url} is incomplete (torn): {required} is missing (a save that did not "
                "finish?); resume from another checkpoint."
            )
    metadata = dcp_reader(url, trust, opt_in, storage_options).read_metadata()
    by_file: dict[str, list[Any]] = {}
    for info in (metadata.storage_data or {}).values():
        by_file.setdefault(info.relative_path, []).append(info)
    paths, starts, ends, where = [], [], [], []
    for relative, infos in sorted(by_file.items()):
        if relative not in objects:
            raise ValueError(f"the sharded checkpoint at {url} is incomplete: shard object {relative} is missing.")
        size = max(info.offset + info.length for info in infos)
        if objects[relative] < size:
            raise ValueError(
                f"the sharded checkpoint at {url} is truncated: {relative} has {objects[relative]} bytes of the "
                f"{size} its metadata records; resume from another checkpoint."
            )
        for info in infos:
            if getattr(info, "transform_descriptors", None):
                continue  # compressed records have no fixed framing to check
            end = info.offset + info.length
            paths += [f"{path}/{relative}"] * 2
            starts += [info.offset, end - 22]
            ends += [info.offset + 4, end - 18]
            where.append((relative, info.offset))
    found = fs.cat_ranges(paths, starts, ends) if paths else []
    for (relative, offset), start, end in zip(where, found[0::2], found[1::2], strict=True):
        if start != b"PK\x03\x04" or end != b"PK\x05\x06":
            raise ValueError(
                f"the sharded checkpoint at {url} does not fit together: {relative} holds no record at byte {offset} "
                "where its .metadata says one is (shard objects of another checkpoint?); resume from another "
                "checkpoint."
            )
    return metadata


def load_meta_remote(url: str, trust: bool, opt_in: str, storage_options: StorageOptions = None) -> Any:
    """The sharded checkpoint's ``meta.pt`` (small), plain data only unless ``trust``."""
    fs, path = _store(url, storage_options)
    return load_torch_bytes(fs.cat_file(f"{path}/{META_FILE}"), f"{url}/{META_FILE}", trust, opt_in)


@contextmanager
def downloaded_once_per_host(url: str, storage_options: StorageOptions = None) -> Iterator[Path]:
    """A local copy of the object at ``url`` for every rank, downloaded once per host (a collective).

    Every rank then reads the copy memory-mapped and copies only its rows, as from a local file, and no rank
    downloads the file for itself. The lowest rank of each host (by host name) downloads into the host's temporary
    folder; leaving the block --
    which every rank does once it has opened the copy (memory-mapped, which outlives the name) -- deletes it. A
    download that fails on any host raises on every rank.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    host = socket.gethostname()
    hosts: list[Any] = [host]
    name = [uuid.uuid4().hex]
    if distributed:
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, host)
        dist.broadcast_object_list(name, src=0)
    downloads = hosts.index(host) == rank
    local = Path(tempfile.gettempdir()) / f".lightning_fsdp-download-{name[0]}.ckpt"
    error: Exception | None = None
    if downloads:
        try:
            fs, path = _store(url, storage_options)
            if not fs.isfile(path):
                raise FileNotFoundError(f"no checkpoint at {url}; pass a .ckpt object or a sharded checkpoint prefix.")
            fs.get_file(path, str(local))
        except Exception as err:
            local.unlink(missing_ok=True)
            error = err
    errors: list[Any] = [None if error is None else f"{type(error).__name__}: {error}"]
    if distributed:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if any(errors):
        raise RuntimeError(f"downloading {url} failed on another rank: {next(e for e in errors if e)}")
    try:
        yield local
        if distributed:
            dist.barrier()  # every rank has the copy open before its name goes
    finally:
        if downloads:
            local.unlink(missing_ok=True)


@contextmanager
def staged_for_convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    overwrite: bool,
    trust: bool,
    opt_in: str,
    storage_options: StorageOptions = None,
) -> Iterator[tuple[Path, Path]]:
    """Local stand-ins for ``convert``'s ``src`` and ``dst`` where they are URLs: ``(local_src, local_dst)``.

    ``convert`` is one offline process that holds the checkpoint anyway, so a URL source is downloaded into a
    temporary folder first (a sharded one refused as torn before), and a URL destination is written there and
    uploaded when complete: a full file as one object, a sharded folder with ``.metadata`` last. The destination is
    checked before anything is read, as for a local one; only the ``full`` and ``sharded`` forms go to a store.
    """
    if is_remote(dst):
        if to not in ("full", "sharded"):
            raise ValueError(f"--to {to} cannot be written to a store ({dst}); write it locally and upload it.")
        if remote_kind(str(dst), storage_options) is not None:
            refusal = remote_refusal(str(dst), to, storage_options) if overwrite else None
            if not overwrite:
                refusal = (
                    f"{dst} already exists; pass --overwrite to replace a {to} checkpoint there, or choose another."
                )
            if refusal is not None:
                raise FileExistsError(refusal)
    with tempfile.TemporaryDirectory(prefix=".lightning_fsdp-convert-") as tmp:
        local_src = (
            Path(src) if not is_remote(src) else _download(str(src), Path(tmp, "src"), trust, opt_in, storage_options)
        )
        local_dst = Path(dst) if not is_remote(dst) else Path(tmp, "dst")
        yield local_src, local_dst
        if is_remote(dst):
            _upload(local_dst, str(dst), storage_options)


def _download(url: str, local: Path, trust: bool, opt_in: str, storage_options: StorageOptions) -> Path:
    kind = remote_kind(url, storage_options)
    if kind is None:
        raise FileNotFoundError(f"no checkpoint at {url}.")
    fs, path = _store(url, storage_options)
    if kind == "full":
        fs.get_file(path, str(local))
        return local
    read_checked_metadata_remote(url, trust, opt_in, storage_options)  # a torn prefix is refused, not copied
    local.mkdir()
    for name in _objects_under(fs, path):
        if _SHARDED_OBJECTS.match(name):
            fs.get_file(f"{path}/{name}", str(local / name))
    return local


def _upload(local: Path, url: str, storage_options: StorageOptions) -> None:
    """Put a finished local checkpoint at ``url``: a file as one object, a folder's ``.metadata`` last."""
    fs, path = _store(url, storage_options)
    if local.is_file():
        fs.put_file(str(local), path)
        return
    _remove_sharded(fs, path)
    files = sorted(local.iterdir(), key=lambda file: file.name.endswith(DCP_METADATA_FILE))
    for file in files:
        fs.put_file(str(file), f"{path}/{file.name}")
