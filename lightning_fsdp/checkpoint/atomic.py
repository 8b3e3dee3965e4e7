"""Atomic checkpoint writes: a checkpoint appears under its final name only when it is complete.

Everything is written into a temporary sibling of the target (same directory, so the final ``rename`` stays on one
file system and is atomic), made durable with ``fsync``, and then renamed into place. A crash at any point leaves
the previous checkpoint under the final name untouched and, at worst, a ``.partial-*`` sibling behind, which the
next save into the same folder removes. The temporary names contain neither the checkpoint's name nor ``.ckpt``,
so nothing that lists checkpoints (``ModelCheckpoint`` resolving ``"last"``, say) ever sees a partial one.
Replacing an existing folder takes two renames (old one aside, new one in); the old one is deleted only after the
new one is in place.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

PARTIAL_PREFIX = ".partial-"


def _sibling(path: Path, tag: str) -> Path:
    return path.with_name(f"{PARTIAL_PREFIX}{tag}.tmp")  # a suffix: torch.save names its archive by the stem


def _fsync_tree(path: Path) -> None:
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if item.is_file():
            with open(item, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(path: Path) -> None:
    """Delete what interrupted saves into ``path``'s folder left behind."""
    for stale in path.parent.glob(f"{PARTIAL_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


def publish(tmp: Path, final: Path) -> None:
    """Move a complete ``tmp`` (file or folder) to ``final``, replacing what was there, atomically."""
    _fsync_tree(tmp)
    if final.is_dir() and not final.is_symlink():
        aside = _sibling(final, "old-" + uuid.uuid4().hex)
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_file_atomically(final: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``final`` (one process)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final)
    tmp = _sibling(final, uuid.uuid4().hex)
    try:
        write(tmp)
        publish(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder every rank writes into; rank 0 publishes it as ``final`` once all are done.

    A collective: every rank enters and leaves it. If any rank fails inside, nothing is published.
    """
    final = Path(final)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    name = [uuid.uuid4().hex]
    if distributed:
        dist.broadcast_object_list(name, src=0)
    tmp = _sibling(final, name[0])
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(final)
        tmp.mkdir()
    if distributed:
        dist.barrier()
    yield tmp
    if distributed:
        dist.barrier()  # every rank has written its part
    if rank == 0:
        publish(tmp, final)
    if distributed:
        dist.barrier()  # nobody reads the checkpoint before it is in place
