"""Our temporary folders: how they are named, how each writer marks its claim, and when a leftover may go.

Every save writes into a hidden sibling ``.partial-<uuid>.tmp`` of its destination (see ``atomic.py``). Each process
that writes into one drops a *writer file* into it, ``.lightning_fsdp-writer-<rank>``: a small JSON record of who it
is (pid, host, the kernel's boot id, the pid namespace, the process's start time) on which it holds an exclusive
``flock`` for as long as it writes. A save killed mid-write leaves the folder and its writer files behind, and the
kernel drops the lock with the process. The next save into the same folder removes a temporary only when

- its name has our shape, it is a real folder (not a link), and it holds at least one writer file of ours, and
- no writer file's lock is held (the writer is gone, whatever its pid is now: after a container restart the new
  process often gets the very pid the killed one had, so a pid alone says nothing).

Where the file system has no locks, the record decides, and only where it can prove the writer dead: same boot, same
pid namespace, and that pid gone or started at another time; or the same host booted since. Anything else -- a
user's ``.partial-foo``, a folder without a writer file, a writer we cannot prove dead -- is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import IO, Any

PARTIAL_PREFIX = ".partial-"
WRITER_PREFIX = ".lightning_fsdp-writer-"
_TEMPORARY = re.compile(rf"^{re.escape(PARTIAL_PREFIX)}[0-9a-f]{{32}}\.tmp$")
_WRITER = re.compile(rf"^{re.escape(WRITER_PREFIX)}(\d+)$")
_OWN_KEY = "lightning_fsdp_writer"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


def temporary_sibling(path: Path) -> Path:
    """A fresh temporary name beside ``path``: neither its name nor ``.ckpt``, so nothing that lists checkpoints
    (``ModelCheckpoint`` resolving ``"last"``, say) ever sees a partial one."""
    return path.with_name(f"{PARTIAL_PREFIX}{uuid.uuid4().hex}.tmp")


def writer_file(folder: Path, rank: int) -> Path:
    return folder / f"{WRITER_PREFIX}{rank}"


def claim(folder: Path, rank: int = 0, token: str = "") -> IO[str]:
    """Mark ``folder`` as being written by this process (as ``rank``, for the save ``token`` names); the returned
    handle holds the lock: close it (``release``) when done. The file appears under its name already locked and
    complete (written aside, then renamed), so nobody reads a record half-written."""
    final = writer_file(folder, rank)
    aside = folder / f".{uuid.uuid4().hex}.writing"
    handle = open(aside, "x")  # noqa: SIM115 -- the lock lives as long as this handle
    try:
        with contextlib.suppress(OSError):  # no locks on this file system: the record alone speaks
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        json.dump({_OWN_KEY: 1, "token": token, **_identity(os.getpid())}, handle)
        handle.flush()
        os.replace(aside, final)
    except BaseException:
        handle.close()
        aside.unlink(missing_ok=True)
        raise
    return handle


def release(handle: IO[str] | None) -> None:
    if handle is not None:
        handle.close()


def writer_ranks(folder: Path) -> list[int]:
    """The ranks whose writer files this process sees in ``folder``."""
    return sorted(int(found.group(1)) for entry in folder.iterdir() if (found := _WRITER.match(entry.name)))


def unclaim_all(folder: Path) -> None:
    """Remove every writer file from a folder about to be published (the handles keep their locks until closed)."""
    for entry in folder.iterdir():
        if _WRITER.match(entry.name):
            entry.unlink(missing_ok=True)


def delete_temporary(folder: Path) -> None:
    """Delete one of our temporaries, its writer files last, so that a crash midway leaves it still marked."""
    if not folder.is_dir() or folder.is_symlink():
        return
    with contextlib.suppress(FileNotFoundError):  # the other ranks that share it delete it at the same time
        for entry in list(folder.iterdir()):
            if _WRITER.match(entry.name):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)


def discard(folder: Path) -> None:
    """Delete a folder we renamed aside (an old checkpoint being replaced or removed), marked first as ours.

    The mark is a courtesy to the next save (a crash midway leaves a folder it can remove): a disk too full to take
    it must not fail a save that is already published.
    """
    try:
        handle: IO[str] | None = claim(folder)
    except OSError:
        handle = None
    try:
        delete_temporary(folder)
    finally:
        release(handle)


def remove_stale_temporaries(path: Path) -> None:
    """Delete what interrupted saves into ``path``'s folder left behind: our temporaries no live writer holds."""
    if not path.parent.is_dir():
        return
    for entry in path.parent.iterdir():
        if _is_stale(entry):
            delete_temporary(entry)


def _is_stale(entry: Path) -> bool:
    if not _TEMPORARY.match(entry.name) or not entry.is_dir() or entry.is_symlink():
        return False
    try:
        verdicts = [_writer_alive(item) for item in entry.iterdir() if _WRITER.match(item.name)]
    except FileNotFoundError:  # another process removed it meanwhile
        return False
    return bool(verdicts) and all(verdict is False for verdict in verdicts)


def _writer_alive(file: Path) -> bool | None:
    """Whether the writer that made ``file`` still runs; None when the file is not one of ours (or not yet)."""
    record = _record(file)
    if record is None:
        return None
    try:
        with open(file) as handle:
            try:  # a shared lock is all a read-only handle may take everywhere (NFS), and the writer's excludes it
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            return False
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            return None
    return not _provably_dead(record)


def _record(file: Path) -> dict[str, Any] | None:
    if file.is_symlink() or not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get(_OWN_KEY) == 1 else None


def _provably_dead(record: dict[str, Any]) -> bool:
    here = _identity(os.getpid())
    if record.get("boot") != here["boot"] or record.get("boot") is None:
        return record.get("host") == here["host"] and record.get("boot") is not None  # the same host, rebooted
    if record.get("pidns") != here["pidns"] or record.get("pidns") is None:
        return False  # another container's pids: nothing to check them against
    pid = record.get("pid")
    return not isinstance(pid, int) or _start_time(pid) != record.get("started")


def _identity(pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _link("/proc/self/ns/pid"),
        "started": _start_time(pid),
    }


def _start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (None when no such process): a reused pid has another."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in parentheses may hold spaces


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None
