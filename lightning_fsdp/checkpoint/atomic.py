"""Atomic checkpoint writes: a checkpoint appears under its final name only when it is complete.

Everything is written into a temporary sibling of the target (same directory, so the final ``rename`` stays on one
file system and is atomic), made durable with ``fsync``, and then renamed into place. A crash at any point leaves
the previous checkpoint under the final name untouched and, at worst, a ``.partial-*`` sibling behind, which the
next save into the same folder removes. The temporary names contain neither the checkpoint's name nor ``.ckpt``,
so nothing that lists checkpoints (``ModelCheckpoint`` resolving ``"last"``, say) ever sees a partial one.

A file replaces a file in one ``rename``. A folder cannot replace a non-empty folder that way, so on Linux the two
swap names in one atomic step (``renameat2`` with ``RENAME_EXCHANGE``) and the old one, now under the temporary
name, is deleted. Elsewhere it takes two renames (old one aside, new one in): a crash between them leaves nothing
under the final name, with the old checkpoint complete in a ``.partial-old-*`` sibling until the next save.
Removal renames a folder aside before deleting it, so a crash mid-delete leaves no torn folder under its name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
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
        if _exchange(tmp, final):  # now ``final`` is the new folder and ``tmp`` the old one
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            aside = _sibling(final, "old-" + uuid.uuid4().hex)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` in one atomic step; False where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc 2.28+
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or folder (a link: only the link); a folder leaves its name in one step first."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        aside = _sibling(path, "removed-" + uuid.uuid4().hex)
        os.replace(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
