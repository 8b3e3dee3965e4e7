"""A streaming safetensors writer: the header first, then each tensor's bytes as it is produced.

``safetensors.torch.save_file`` needs every tensor in memory at once; converting a checkpoint bigger than memory
needs one at a time. The format is simple and fixed (an 8-byte little-endian header length, a JSON header of
names, dtypes, shapes and byte offsets, then the raw little-endian data), and every shape and dtype is known
before any tensor is read, so the header is written up front. Files are read back with ``safetensors`` itself.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    path: Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    load: Callable[[str], torch.Tensor],
    progress: Callable[[Iterable[str]], Iterable[str]] = lambda names: names,
) -> None:
    """Write ``specs`` (name, dtype, shape) to ``path``, calling ``load(name)`` for one tensor at a time."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}  # what transformers checks for torch weights
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in _DTYPES:
            raise ValueError(f"'{name}' has dtype {dtype}, which safetensors cannot store.")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name in progress([name for name, _, _ in specs]):
            tensor = load(name).detach().to("cpu").contiguous()
            if tensor.numel():
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes, not a copy
