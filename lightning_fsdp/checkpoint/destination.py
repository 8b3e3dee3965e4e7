"""What a save or a convert may replace: nothing but a checkpoint of the same form, or nothing at all.

A checkpoint is published by renaming it over its destination (see ``atomic.py``), which deletes whatever was there.
That is right for the previous ``last.ckpt`` and wrong for a user's folder that happens to have the name, so every
writer asks ``refusal_to_replace`` first, before it writes a byte: a file may replace only a file of its own form
(a ``torch.save`` archive, a safetensors file), a sharded folder only a folder holding nothing but a sharded
checkpoint's files (or nothing). Anything else is refused with a sentence that says what is there.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path

# The files each folder form writes. Sharded: DCP's shard files and metadata (one per rank in some torch versions),
# meta.pt. hf: transformers' weights (one file, or numbered shards and their index) and the config copied beside.
_FOLDER_FILES = {
    "sharded": re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata|meta\.pt)$"),
    "hf": re.compile(r"^(model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|config\.json)$"),
}
_FOLDER_NAMES = {"sharded": "a sharded checkpoint", "hf": "a Hugging Face weights folder"}


def refusal_to_replace(path: str | os.PathLike, form: str) -> str | None:
    """Why a ``form`` checkpoint must not be written at ``path`` (one sentence), or None when it may.

    ``form`` is ``"full"`` (one ``torch.save`` file), ``"sharded"`` or ``"hf"`` (folders) or ``"safetensors"``.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    advice = "choose another path, or remove it yourself if it should go."
    if form in _FOLDER_FILES:
        what = _FOLDER_NAMES[form]
        if not path.is_dir():
            return f"{path} is a file; {what} is a folder and will not replace it: {advice}"
        foreign = sorted(entry.name for entry in path.iterdir() if not _written_by(form, entry))
        if foreign:
            return (
                f"{path} is a folder holding files that are not part of {what} "
                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}), which a save would delete: {advice}"
            )
        return None
    if path.is_dir():
        return f"{path} is a folder; a {form} checkpoint is one file and will not replace it: {advice}"
    if path.is_symlink() and not path.exists():
        return None  # a dangling link (Lightning's ``save_last="link"`` to a removed checkpoint): only the link goes
    if form == "full" and not _is_torch_archive(path):
        return f"{path} exists and is not a checkpoint (not a torch.save archive), which a save would delete: {advice}"
    if form == "safetensors" and not _is_safetensors(path):
        return f"{path} exists and is not a safetensors file, which a save would delete: {advice}"
    return None


def _written_by(form: str, entry: Path) -> bool:
    return entry.is_file() and not entry.is_symlink() and bool(_FOLDER_FILES[form].match(entry.name))


def _is_torch_archive(path: Path) -> bool:
    return path.is_file() and zipfile.is_zipfile(path)


def _is_safetensors(path: Path) -> bool:
    """An 8-byte little-endian header length followed by that many bytes of a JSON object."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                return False
            return isinstance(json.loads(handle.read(length)), dict)
    except (OSError, struct.error, ValueError):
        return False
