"""Atomic checkpoint writes: a checkpoint appears under its final name only when it is complete.

Everything is written into a temporary sibling of the target (same directory, so the final ``rename`` stays on one
file system and is atomic), made durable with ``fsync``, and then renamed into place. A crash at any point leaves
the previous checkpoint under the final name untouched and, at worst, a ``.partial-<pid>-*`` sibling behind, which
the next save into the same folder removes once that pid is gone; a failure Python sees (a full disk) removes its
temporary at once. The temporary names contain neither the checkpoint's name nor ``.ckpt``, so nothing that lists
checkpoints (``ModelCheckpoint`` resolving ``"last"``, say) ever sees a partial one. Nothing is ever written over a
path that is not a checkpoint of the same form (see ``destination.py``).

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
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_fsdp.checkpoint.destination import refusal_to_replace

PARTIAL_PREFIX = ".partial-"
# Our temporaries carry the pid of the process that publishes them, so that only leftovers of dead processes are
# reaped: a name of this shape whose writer still runs is a save in progress (another job, or a background save).
_TEMPORARY = re.compile(rf"^{re.escape(PARTIAL_PREFIX)}(\d+)-[0-9a-z-]+\.tmp$")


def _sibling(path: Path, tag: str) -> Path:
    # A suffix, not the checkpoint's name: torch.save names its archive by the stem, and nothing that lists
    # checkpoints may ever see a partial one.
    return path.with_name(f"{PARTIAL_PREFIX}{os.getpid()}-{tag}.tmp")


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


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: Path) -> None:
    """Delete what interrupted saves into ``path``'s folder left behind: our temporaries whose writer is dead."""
    for stale in path.parent.glob(f"{PARTIAL_PREFIX}*"):
        found = _TEMPORARY.match(stale.name)
        if found is None or _is_alive(int(found.group(1))):
            continue
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() and not stale.is_symlink() else stale.unlink(
            missing_ok=True
        )


def tensor_bytes(state: Any) -> int:
    """About the bytes ``state`` takes on disk: its tensors' data (this rank's part of a DTensor)."""
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def check_destination(final: Path, form: str, expected_bytes: int = 0) -> str | None:
    """Why ``final`` must not receive a ``form`` checkpoint of about ``expected_bytes`` (a sentence), or None."""
    refusal = refusal_to_replace(final, form)
    if refusal is not None:
        return refusal
    folder = _existing_ancestor(final.parent)
    free = shutil.disk_usage(folder).free
    if expected_bytes > free:
        return _out_of_space_message(final, expected_bytes, free)
    return None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _out_of_space_message(final: Path, expected_bytes: int, free: int | None = None) -> str:
    free_text = f", {_megabytes(free)} free" if free is not None else ""
    return (
        f"no space left on device: needed ~{_megabytes(expected_bytes)} at {final.parent}{free_text}; "
        "free some space or save somewhere else (nothing was left behind)."
    )


def _megabytes(nbytes: int) -> str:
    megabytes = nbytes / 2**20
    return f"{megabytes:.1f} MB" if megabytes < 10 else f"{megabytes:.0f} MB"


def out_of_space(err: BaseException, final: Path, expected_bytes: int) -> OSError | None:
    """``err`` as one clear ``OSError(ENOSPC)`` if the disk ran full under it, else None.

    torch.save reports a full disk as ``RuntimeError: ... unexpected pos``, DCP as a ``CheckpointException`` that
    holds each rank's error as text; the free space left on the device decides when the error itself does not say.
    """
    chain, cause = [], err
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    said = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain) or any(
        "No space left on device" in str(e) for e in chain
    )
    free = shutil.disk_usage(_existing_ancestor(final.parent)).free
    if not said and free >= max(expected_bytes, 1) // 16 + 2**20:
        return None
    return OSError(errno.ENOSPC, _out_of_space_message(final, expected_bytes, free))


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


def write_file_atomically(
    final: str | os.PathLike, write: Callable[[Path], None], form: str = "full", expected_bytes: int = 0
) -> None:
    """Call ``write(tmp_path)`` and move the result to ``final`` (one process).

    Refused before anything is written when ``final`` is not a ``form`` checkpoint we may replace, or the disk has
    less than ``expected_bytes`` free; a write that fails (a full disk, say) leaves no temporary behind.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    refusal = check_destination(final, form, expected_bytes)
    if refusal is not None:
        raise (OSError(errno.ENOSPC, refusal) if refusal.startswith("no space") else FileExistsError(refusal))
    remove_stale_temporaries(final)
    tmp = _sibling(final, uuid.uuid4().hex)
    try:
        write(tmp)
        publish(tmp, final)
    except BaseException as err:
        full = out_of_space(err, final, expected_bytes) if isinstance(err, Exception) else None
        if full is not None:
            raise full from err
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


@contextmanager
def atomic_directory(
    final: str | os.PathLike, expected_bytes: int = 0, form: str = "sharded", collective: bool = True
) -> Iterator[Path]:
    """Yield a temporary folder every rank writes into; rank 0 publishes it as ``final`` once all are done.

    A collective: every rank enters and leaves it. Rank 0 checks the destination first (see ``destination.py``; a
    folder ``form``, "sharded" or "hf") and
    every rank raises its refusal before anything is written. If any rank fails inside, every rank raises and the
    temporary is removed: nothing is published and nothing is left behind. ``expected_bytes`` is this rank's share.
    ``collective=False``: one process writes the folder alone, whether or not it belongs to a process group.
    """
    final = Path(final)
    distributed = collective and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    decision = [None, None]
    if rank == 0:
        refusal = check_destination(final, form, expected_bytes * world_size)
        decision = [_sibling(final, uuid.uuid4().hex).name, refusal]
    if distributed:
        dist.broadcast_object_list(decision, src=0)
    name, refusal = decision
    if refusal is not None:
        raise OSError(errno.ENOSPC, refusal) if refusal.startswith("no space") else FileExistsError(refusal)
    tmp = final.with_name(name)
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(final)
        tmp.mkdir()
    if distributed:
        dist.barrier()
    failure: BaseException | None = None
    try:
        yield tmp
    except BaseException as err:
        failure = err
    failed = [failure is not None]
    if distributed:  # instead of a barrier: every rank learns whether any rank failed to write its part
        everyone: list[list[bool] | None] = [None] * world_size
        dist.all_gather_object(everyone, failed)
        failed = [any(flag[0] for flag in everyone if flag is not None)]
    if failed[0]:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is None:
            raise RuntimeError(
                f"the sharded save to {final} failed on another rank (see its error); nothing was saved."
            )
        full = out_of_space(failure, final, expected_bytes * world_size) if isinstance(failure, Exception) else None
        if full is not None:
            raise full from failure
        raise failure
    if rank == 0:
        publish(tmp, final)
    if distributed:
        dist.barrier()  # nobody reads the checkpoint before it is in place
