"""Reading checkpoint files without running code from them, unless the user says they trust the file.

A checkpoint is a pickle, and unpickling can call any function the file names: a ``.ckpt`` or a ``meta.pt`` with a
hostile ``__reduce__`` runs its code the moment it is loaded. Everything our own checkpoints hold is plain data --
tensors, numbers, strings, containers, paths -- so every read goes through ``torch.load(weights_only=True)`` with a
small allow-list, and the DCP ``.metadata`` file (a plain pickle torch reads with ``pickle.load``) through a
restricted unpickler that knows only the metadata's own classes. A file that needs anything else is refused with
one sentence naming the file, the global it asked for and the opt-in (``trust=True``), which restores torch's
unrestricted loading for users who wrote the file themselves.

A file that is not a ``torch.save`` archive at all (empty, text, random bytes) is refused as "not a checkpoint"
before torch sees it: torch's own error for it is advice about ``_use_new_zipfile_serialization``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from lightning_fsdp.checkpoint.location import is_remote

__all__ = [
    "UntrustedCheckpointError",
    "check_is_torch_archive",
    "load_torch_file",
    "load_torch_bytes",
    "read_dcp_metadata",
    "dcp_load_planner",
    "dcp_reader",
]

# What Lightning checkpoints hold beyond torch's own weights-only allow-list: paths (a datamodule's ``data_dir``
# saved in its hyperparameters, say). Constructing a path runs no code of the file's choosing.
SAFE_GLOBALS = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]

# The classes a DCP ``.metadata`` pickle names (torch 2.5 - 2.13), by module.
_DCP_METADATA_CLASSES = {
    dcp_metadata.__name__: {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    dcp_filesystem.__name__: {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "builtins": {"set", "frozenset", "slice"},
}

_GLOBAL_IN_TORCH_MESSAGE = re.compile(r"GLOBAL ([\w.]+)")


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint asked to unpickle something that is not plain data, and the user did not opt in."""


def check_is_torch_archive(path: str | os.PathLike) -> None:
    """Refuse, in one sentence naming the file, anything ``torch.save`` did not write (or that is truncated)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}.")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is not a checkpoint: the file is empty (an interrupted copy?).")
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{path} is not a checkpoint: it is not an archive written by torch.save (a text file, random bytes or "
            "a truncated copy?); pass a .ckpt file or a sharded checkpoint folder."
        )


def load_torch_file(path: str | os.PathLike, trust: bool, opt_in: str, mmap: bool = True) -> Any:
    """``torch.load`` of ``path`` to the CPU: plain data only unless ``trust``; ``opt_in`` names how to trust it."""
    check_is_torch_archive(path)
    return _torch_load(path, path, trust, opt_in, mmap)


def load_torch_bytes(data: bytes, name: str, trust: bool, opt_in: str) -> Any:
    """``load_torch_file`` of a file's bytes (a ``meta.pt`` read from an object store); ``name`` names it."""
    if not data:
        raise ValueError(f"{name} is not a checkpoint: the object is empty (an interrupted upload?).")
    buffer = io.BytesIO(data)
    if not zipfile.is_zipfile(buffer):
        raise ValueError(f"{name} is not a checkpoint: it is not an archive written by torch.save.")
    buffer.seek(0)
    return _torch_load(buffer, name, trust, opt_in, mmap=False)


def _torch_load(source: str | os.PathLike | io.BytesIO, name: object, trust: bool, opt_in: str, mmap: bool) -> Any:
    if trust:
        return torch.load(source, map_location="cpu", mmap=mmap, weights_only=False)
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(source, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL_IN_TORCH_MESSAGE.search(str(err))
        raise _untrusted(str(name), found.group(1) if found else "an object that is not plain data", opt_in) from None


def _untrusted(path: str | os.PathLike, name: str, opt_in: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"refusing to load {path}: it contains {name}, which is not plain data, and unpickling it could run code "
        f"from the file; if you trust this file (you wrote it), load it with {opt_in}."
    )


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals a DCP ``.metadata`` file names (and torch dtypes)."""

    def __init__(self, file: io.BufferedIOBase, path: Path, opt_in: str) -> None:
        super().__init__(file)
        self._path = path
        self._opt_in = opt_in

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise _untrusted(self._path, f"{module}.{name}", self._opt_in)


def read_dcp_metadata(
    path: str | os.PathLike, trust: bool, opt_in: str, storage_options: dict[str, Any] | None = None
) -> Metadata:
    """The ``.metadata`` of the DCP folder ``path``, read by the restricted unpickler unless ``trust``."""
    return dcp_reader(path, trust, opt_in, storage_options).read_metadata()


def dcp_reader(
    path: str | os.PathLike, trust: bool, opt_in: str, storage_options: dict[str, Any] | None = None
) -> FileSystemReader:
    """A DCP reader for ``path`` whose metadata read runs no code from the file unless ``trust``.

    ``path`` is a local folder, or an fsspec URL (``s3://bucket/prefix``) read through torch's ``FsspecReader`` with
    ``storage_options`` (see ``remote.py``).
    """
    if is_remote(path):
        options = storage_options or {}
        return FsspecReader(path, **options) if trust else _SafeFsspecReader(path, opt_in, **options)
    return FileSystemReader(path) if trust else _SafeFileSystemReader(path, opt_in)


class _SafeMetadataRead:
    """torch's ``read_metadata``, except that ``.metadata`` goes through ``_MetadataUnpickler``, not ``pickle.load``."""

    _opt_in: str

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        try:
            with self.fs.create_stream(file, "rb") as handle:  # type: ignore[attr-defined]
                metadata = _MetadataUnpickler(handle, file, self._opt_in).load()
        except UntrustedCheckpointError:
            raise
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
            raise ValueError(
                f"{file} is not a checkpoint's metadata ({err}); resume from another checkpoint."
            ) from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{file} is not a checkpoint's metadata (it holds a {type(metadata).__name__}).")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class _SafeFileSystemReader(_SafeMetadataRead, FileSystemReader):
    def __init__(self, path: str | os.PathLike, opt_in: str) -> None:
        super().__init__(path)
        self._opt_in = opt_in


class _SafeFsspecReader(_SafeMetadataRead, FsspecReader):
    def __init__(self, path: str | os.PathLike, opt_in: str, **storage_options: Any) -> None:
        super().__init__(path, **storage_options)
        self._opt_in = opt_in


def dcp_load_planner(trust: bool, opt_in: str) -> DefaultLoadPlanner:
    """DCP's default load planner; non-tensor values (stored as ``torch.save`` bytes) read as plain data only."""
    return DefaultLoadPlanner() if trust else _SafeLoadPlanner(opt_in)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP loads non-tensor items with ``torch.load(weights_only=False)``; this one does it with ``True``."""

    def __init__(self, opt_in: str) -> None:
        super().__init__()
        self._opt_in = opt_in

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS):
                loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            found = _GLOBAL_IN_TORCH_MESSAGE.search(str(err))
            name = found.group(1) if found else "an object that is not plain data"
            raise _untrusted(f"the checkpoint item {read_item.dest_index.fqn}", name, self._opt_in) from None
        # The base class knows where the value goes (nested state dicts are flattened); hand it the value again as
        # bytes it will unpickle itself -- now bytes this process wrote, of plain data.
        clean = io.BytesIO()
        torch.save(loaded, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
