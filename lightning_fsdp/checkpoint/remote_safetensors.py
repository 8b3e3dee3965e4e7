"""A safetensors file in an object store, read by byte ranges: the header once, then only the rows asked for.

safetensors lays every tensor out contiguously, row-major, at offsets its JSON header records, so the rows
``[a, b)`` of a tensor are one byte range. ``load_pretrained`` at a URL opens each file with ``open_remote`` instead
of ``safe_open`` and reads through the same three calls (``keys``, ``get_slice(name)[rows]`` with ``get_shape()``,
``get_tensor``): each rank fetches its own rows of each sharded parameter and nothing else.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch
from fsspec.core import url_to_fs

__all__ = ["RemoteSafetensors"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000


class RemoteSafetensors:
    """``safe_open(url, framework="pt")`` for a URL: a context manager with ``keys``, ``get_slice``, ``get_tensor``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._fs, self._path = url_to_fs(url, **(storage_options or {}))
        try:
            (length,) = struct.unpack("<Q", self._fs.cat_file(self._path, start=0, end=8))
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(self._fs.cat_file(self._path, start=8, end=8 + length))
        except (struct.error, ValueError) as err:
            raise ValueError(f"{url} is not a safetensors file ({err}).") from None
        header.pop("__metadata__", None)
        self._header: dict[str, dict[str, Any]] = header
        self._base = 8 + length

    def __enter__(self) -> RemoteSafetensors:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def keys(self) -> list[str]:
        return list(self._header)

    def get_slice(self, key: str) -> _RemoteSlice:
        return _RemoteSlice(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[:]

    def _read(self, key: str, rows: slice) -> torch.Tensor:
        entry = self._header[key]
        dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin = self._base + entry["data_offsets"][0]
        if not shape:
            data = self._fs.cat_file(self._path, start=begin, end=begin + dtype.itemsize)
            return torch.frombuffer(bytearray(data), dtype=dtype).reshape(())
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError(f"reading every {step}th row of {key} from {self.url} is not supported.")
        count = max(stop - start, 0)
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if count == 0 or row_bytes == 0:
            return torch.empty((count, *shape[1:]), dtype=dtype)
        data = self._fs.cat_file(self._path, start=begin + start * row_bytes, end=begin + (start + count) * row_bytes)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(count, *shape[1:])


class _RemoteSlice:
    def __init__(self, file: RemoteSafetensors, key: str) -> None:
        self._file, self._key = file, key

    def get_shape(self) -> list[int]:
        return list(self._file._header[self._key]["shape"])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self._file._read(self._key, rows)
