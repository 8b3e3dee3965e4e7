"""A byte-level text corpus that every machine already has: the Python standard library's own sources.

The demos and tests need real text to show a loss that falls, without downloading a data set (the machines
that run them may have no network). Every Python installation ships a few tens of megabytes of its own
``.py`` sources; a couple of megabytes of them, read as bytes, give a vocabulary of 256 tokens and a model
that learns visible structure (indentation, keywords, identifiers) within a few dozen steps. A user's own
text file can be used instead.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256
"""Byte-level: every token is one byte."""

__all__ = ["VOCAB_SIZE", "load_corpus", "random_batches"]


def load_corpus(path: str | os.PathLike[str] | None = None, max_bytes: int = 2_000_000) -> torch.Tensor:
    """The first ``max_bytes`` bytes of ``path``, or of the standard library's sources when ``path`` is None.

    The standard library's ``*.py`` files are read in sorted path order (installed third-party packages
    under it are skipped), so the corpus is the same on every machine with the same Python version.

    Returns:
        A 1-D ``torch.long`` tensor of byte values in ``[0, 256)``.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        data = _stdlib_source_bytes(max_bytes)
    else:
        with open(path, "rb") as file:
            data = file.read(max_bytes)
    if not data:
        raise ValueError(f"the corpus {path or 'of the standard library sources'} is empty")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def random_batches(
    tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows of ``block_size`` tokens at random offsets, and the same windows shifted by one.

    The offsets come from ``generator`` alone, so a given seed always yields the same batches; data-parallel
    ranks give their generators different seeds to see different data.

    Returns:
        ``(inputs, targets)``, both ``(batch_size, block_size)`` long tensors on ``tokens``' device, with
        ``targets[:, t]`` the token that follows ``inputs[:, t]``.
    """
    if tokens.numel() <= block_size:
        raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than block_size + 1 = {block_size + 1}")
    starts = torch.randint(0, tokens.numel() - block_size, (batch_size, 1), generator=generator)
    positions = (starts + torch.arange(block_size)).to(tokens.device)  # (batch_size, block_size)
    return tokens[positions], tokens[positions + 1]


def _stdlib_source_bytes(max_bytes: int) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    third_party = {"site-packages", "dist-packages"}
    files = sorted(f for f in stdlib.rglob("*.py") if third_party.isdisjoint(f.relative_to(stdlib).parts))
    chunks: list[bytes] = []
    total = 0
    for file in files:
        chunk = file.read_bytes()[: max_bytes - total]
        chunks.append(chunk)
        total += len(chunk)
        if total == max_bytes:
            break
    return b"".join(chunks)
