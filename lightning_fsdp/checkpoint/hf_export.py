"""``lightning-fsdp convert CKPT OUT_DIR --to hf``: a folder Hugging Face ``from_pretrained`` reads.

transformers expects, in one folder, ``model.safetensors`` -- or, above a size limit, numbered shards
(``model-00001-of-00003.safetensors``, ...) plus ``model.safetensors.index.json`` mapping every tensor to its shard --
under the model's own names, beside its ``config.json``. A Lightning checkpoint names the same tensors under the
LightningModule's attribute (``model.model.layers.0...`` for ``self.model = LlamaForCausalLM(...)``): that first name
part, shared by every key, is stripped unless the caller says otherwise. Tensors stream one at a time (see
``safetensors_stream.py``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from lightning_fsdp.checkpoint.atomic import atomic_directory
from lightning_fsdp.checkpoint.pretrained import INDEX_FILE, SINGLE_FILE
from lightning_fsdp.checkpoint.safetensors_stream import write_safetensors

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "lightning_prefix", "write_hf_folder"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default ``max_shard_size`` ("5GB")

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def lightning_prefix(names: Iterable[str]) -> str:
    """The first name part every key shares (the LightningModule attribute holding the model), or ``""``."""
    firsts = {name.split(".", 1)[0] for name in names if "." in name}
    names = list(names)
    if len(firsts) == 1 and all("." in name for name in names):
        return firsts.pop() + "."
    return ""


def write_hf_folder(
    dst: Path,
    specs: list[Spec],
    load: Callable[[str], torch.Tensor],
    config: Path | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[Iterable[str]], Iterable[str]] = lambda names: names,
) -> None:
    """Write ``specs`` (name, dtype, shape; read with ``load``) as a transformers weights folder at ``dst``, atomically.

    ``dst`` must not exist, or be such a folder (``convert`` decides whether it may be replaced).
    """
    shards = _split(specs, max_shard_bytes)
    total = sum(_nbytes(spec) for spec in specs)
    with atomic_directory(dst, expected_bytes=total, form="hf", collective=False) as tmp:
        if len(shards) == 1:
            write_safetensors(tmp / SINGLE_FILE, shards[0], load, progress)
        else:
            weight_map = {}
            for number, shard in enumerate(shards, start=1):
                name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                write_safetensors(tmp / name, shard, load, progress)
                weight_map.update({spec[0]: name for spec in shard})
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        if config is not None:
            shutil.copyfile(config, tmp / "config.json")


def _nbytes(spec: Spec) -> int:
    _, dtype, shape = spec
    return torch.Size(shape).numel() * dtype.itemsize


def _split(specs: list[Spec], max_shard_bytes: int) -> list[list[Spec]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own), as transformers."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + _nbytes(spec) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += _nbytes(spec)
    return shards
