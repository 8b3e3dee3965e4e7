"""Atomic checkpoint writes: a checkpoint appears under its final name only when it is complete.

Everything is written into a temporary sibling of the target (same directory, so the final ``rename`` stays on one
file system and is atomic), made durable with ``fsync``, and then renamed into place (``publish``). A crash at any
point leaves the previous checkpoint under the final name untouched and, at worst, a ``.partial-<uuid>.tmp`` sibling
behind, marked by its writers, which the next save into the same folder removes once no writer holds it (see
``temporaries.py``); a failure Python sees (a full disk) removes its temporary at once. Nothing is ever written over
a path that is not a checkpoint of the same form (see ``destination.py``). Ranks that write one sharded checkpoint
need not share a disk (see [Note: ranks that share no disk] above ``atomic_directory``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_fsdp.checkpoint.destination import refusal_to_replace
from lightning_fsdp.checkpoint.temporaries import (
    claim,
    delete_temporary,
    discard,
    release,
    remove_stale_temporaries,
    temporary_sibling,
    unclaim_all,
    writer_ranks,
)

__all__ = [
    "Ranks",
    "atomic_directory",
    "check_destination",
    "out_of_space",
    "publish",
    "raise_on_every_rank",
    "refuse_on_every_rank",
    "remove",
    "remove_stale_temporaries",
    "tensor_bytes",
    "write_file_atomically",
]


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


class NoSpace(str):
    """A refusal or failure for want of space: raised as ``OSError(ENOSPC)`` (``refusal_error``), where any other
    refusal of a destination is a ``FileExistsError``. A ``str``, so it travels between ranks as the sentence it is."""


def refusal_error(refusal: str, whose: str = "") -> OSError:
    """The error a refusal of a destination stands for; ``whose``: the rank it came from, when not this one."""
    said = f"{whose}{refusal}"
    return OSError(errno.ENOSPC, NoSpace(said)) if isinstance(refusal, NoSpace) else FileExistsError(said)


def _out_of_space_message(final: Path, expected_bytes: int, free: int | None = None) -> NoSpace:
    free_text = f", {_megabytes(free)} free" if free is not None else ""
    return NoSpace(
        f"no space left on device: needed ~{_megabytes(expected_bytes)} at {final.parent}{free_text}; "
        "free some space or save somewhere else (nothing was left behind)."
    )


def _megabytes(nbytes: int) -> str:
    megabytes = nbytes / 2**20
    return f"{megabytes:.1f} MB" if megabytes < 10 else f"{megabytes:.0f} MB"


def out_of_space(err: BaseException, final: Path, expected_bytes: int) -> OSError | None:
    """``err`` as one clear ``OSError(ENOSPC)`` if the disk under ``final`` ran full under it, else None.

    torch.save reports a full disk as ``RuntimeError: ... unexpected pos``, DCP as a ``CheckpointException`` (a
    ``BaseException``) holding every rank's error: this rank's entry is looked into (another rank's full disk is its
    own to report, see ``atomic_directory``). The free space left on the device decides when the error does not say.
    """
    if not isinstance(err, (Exception, CheckpointException)):
        return None  # KeyboardInterrupt, SystemExit: not a write that failed
    said = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(err)) or any(
        "No space left on device" in str(e) for e in _causes(err)
    )
    free = shutil.disk_usage(_existing_ancestor(final.parent)).free
    if not said and free >= max(expected_bytes, 1) // 16 + 2**20:
        return None
    return OSError(errno.ENOSPC, _out_of_space_message(final, expected_bytes, free))


def _causes(err: BaseException) -> list[BaseException]:
    """``err`` and what caused it; in place of a ``CheckpointException`` (whose text holds every rank's errors) this
    rank's own error in it and its causes."""
    chain: list[BaseException] = []
    pending = [err]
    while pending and len(chain) < 16:
        cause = pending.pop()
        if isinstance(cause, CheckpointException):
            own = cause.failures.get(dist.get_rank() if dist.is_initialized() else 0)
            pending += [own[0]] if own is not None else []
            continue
        chain.append(cause)
        following = cause.__cause__ or cause.__context__
        pending += [following] if following is not None else []
    return chain


def publish(tmp: Path, final: Path) -> None:
    """Move a complete ``tmp`` (file or folder) to ``final``, replacing what was there, atomically.

    A file replaces a file in one ``rename``. A folder cannot replace a non-empty folder that way, so on Linux the two
    swap names in one atomic step (``renameat2`` with ``RENAME_EXCHANGE``) and the old one, now under the temporary
    name, is deleted. Elsewhere it takes two renames (old one aside, new one in): a crash between them leaves nothing
    under the final name, with the old checkpoint complete in a ``.partial-*`` sibling until the next save.
    """
    _fsync_tree(tmp)
    if final.is_dir() and not final.is_symlink():
        if _exchange(tmp, final):  # now ``final`` is the new folder and ``tmp`` the old one
            discard(tmp)
        else:
            aside = temporary_sibling(final)
            os.replace(final, aside)
            os.replace(tmp, final)
            discard(aside)
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
    """Delete a checkpoint file or folder (a link: only the link); a folder leaves its name in one step first, so a
    crash mid-delete leaves no torn folder under its name.

    Ranks that share the folder may all call this at once: the first rename wins, the others find nothing to do.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        aside = temporary_sibling(path)
        try:
            os.replace(path, aside)
        except FileNotFoundError:
            return
        discard(aside)
    else:
        path.unlink(missing_ok=True)


def _raise_refusal(refusal: str, whose: str = "") -> None:
    raise refusal_error(refusal, whose)


def write_file_atomically(
    final: str | os.PathLike, write: Callable[[Path], None], form: str = "full", expected_bytes: int = 0
) -> None:
    """Call ``write(tmp_path)`` and move the result to ``final`` (one process).

    Refused before anything is written when ``final`` is not a ``form`` checkpoint we may replace, or the disk has
    less than ``expected_bytes`` free; a write that fails (a full disk, say) leaves no temporary behind. The file is
    written inside a marked temporary folder (so a killed write is recognised as ours) and renamed out of it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    refusal = check_destination(final, form, expected_bytes)
    if refusal is not None:
        _raise_refusal(refusal)
    remove_stale_temporaries(final)
    folder = temporary_sibling(final)
    folder.mkdir()
    writer = None
    try:
        writer = claim(folder)
        tmp = folder / "partial"
        write(tmp)
        publish(tmp, final)
    except BaseException as err:
        full = out_of_space(err, final, expected_bytes)
        if full is not None:
            raise full from err
        raise
    finally:
        delete_temporary(folder)
        release(writer)


@dataclass(frozen=True)
class Ranks:
    """The process group an ``atomic_directory`` spans (one process when not collective): the default group, or one
    spanning the same ranks (a background save's own, see ``async_save.py``)."""

    distributed: bool
    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(cls, collective: bool, group: dist.ProcessGroup | None = None) -> Ranks:
        if collective and dist.is_available() and dist.is_initialized():
            return cls(True, dist.get_rank(group), dist.get_world_size(group), group)
        return cls(False, 0, 1)

    def gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)


@dataclass(frozen=True)
class _Verdict:
    """How one rank's part of a save went, in a form every rank can read: ``full`` is an out-of-space sentence."""

    rank: int
    full: str | None
    error: str


def _verdict(failure: BaseException | None, rank: int, final: Path | str, folder_bytes: int) -> _Verdict | None:
    if failure is None:
        return None
    if isinstance(failure, OSError) and isinstance(failure.strerror, NoSpace):
        full: str | None = failure.strerror  # ours already (a refusal, or a write we translated)
    elif not isinstance(final, Path):  # a URL: no local disk to have run full
        full = None
    else:
        translated = out_of_space(failure, final, folder_bytes)
        full = None if translated is None else translated.strerror
    return _Verdict(rank, full, f"{type(failure).__name__}: {failure}")


def _raise_agreed(verdicts: Sequence[_Verdict | None], rank: int, failure: BaseException | None, final: Path) -> None:
    """Raise on every rank if any rank failed: the out-of-space sentence wherever a disk ran full (this rank's own,
    else the first one's), else this rank's own error, else a sentence naming the rank that failed."""
    failed = [verdict for verdict in verdicts if verdict is not None]
    if not failed:
        return
    full = [verdict.full for verdict in failed if verdict.full is not None]
    if full:
        mine = verdicts[rank]
        raise OSError(errno.ENOSPC, NoSpace(mine.full if mine is not None and mine.full else full[0])) from failure
    if failure is not None:
        raise failure
    first = failed[0]
    raise RuntimeError(f"the save to {final} failed on rank {first.rank} ({first.error}); nothing was saved.")


def _publish_owned(tmp: Path, final: Path) -> None:
    """Publish a folder this rank owns, without the writer files (its writers' handles keep their locks till done)."""
    unclaim_all(tmp)
    publish(tmp, final)


def _attempt(step: Callable[[], None]) -> BaseException | None:
    try:
        step()
    except BaseException as err:
        return err
    return None


def _agree(ranks: Ranks, failure: BaseException | None, final: Path, folder_bytes: int) -> None:
    """Every rank learns how every rank's step went (a collective); all raise if any failed (see ``_raise_agreed``)."""
    _raise_agreed(ranks.gather(_verdict(failure, ranks.rank, final, folder_bytes)), ranks.rank, failure, final)


def _raise_first_refusal(refusals: Sequence[str | None], rank: int) -> None:
    """This rank's own refusal, else the first other rank's, named: every rank refuses the same save."""
    if refusals[rank] is not None:
        _raise_refusal(refusals[rank])
    for other, refusal in enumerate(refusals):
        if refusal is not None:
            _raise_refusal(refusal, whose=f"rank {other}: ")


@dataclass(frozen=True)
class _Folder:
    """The temporary one rank writes into, as that rank sees it: the lowest rank that shares it (who publishes it)
    and how many ranks share it. Listing names is enough: the temporary's name is new to this save."""

    owner: int
    size: int

    @classmethod
    def seen_in(cls, tmp: Path) -> _Folder:
        ranks = writer_ranks(tmp)
        return cls(min(ranks), len(ranks))


def _check_folders(folders: Sequence[_Folder], final: Path) -> None:
    """Every rank must see the same ranks as those that see it; anything else is a file system we cannot publish
    on (one that shows new files late), refused on every rank before a byte is written."""
    for rank, folder in enumerate(folders):
        sharing = [other for other, seen in enumerate(folders) if seen.owner == folder.owner]
        if folders[folder.owner] != folder or len(sharing) != folder.size:
            raise RuntimeError(
                f"the ranks saving to {final} disagree about which of them share a folder (rank {rank} sees "
                f"{folder.size} rank(s) from rank {folder.owner} up, rank {folder.owner} sees "
                f"{folders[folder.owner].size}): a file system that shows new files late? Save to a path every rank "
                "sees the same way."
            )


def _copy_rank0_files(tmp: Path, ranks: Ranks, owner: int, names: Sequence[str]) -> None:
    """Give every folder rank 0's own files (a collective, run only when there is more than one folder).

    Every rank takes part in the broadcast even when rank 0 cannot read its files (it then sends nothing and raises).
    """
    files, failure = {}, None
    if ranks.rank == 0:
        try:
            files = {name: (tmp / name).read_bytes() for name in names if (tmp / name).is_file()}
        except OSError as err:
            failure = err
    files = ranks.broadcast(files)
    if failure is not None:
        raise failure
    if owner != ranks.rank or ranks.rank == 0:
        return  # not publishing, or rank 0's own folder
    for name, content in files.items():
        with open(tmp / name, "wb") as handle:
            handle.write(content)
            os.fsync(handle.fileno())


# [Note: ranks that share no disk] A sharded save is written by every rank into the temporary beside *its own*
# destination: the ranks may give different paths (Ray Train gives every worker its own folder) or the same path that
# lies on different disks (nodes without a shared file system). Which ranks share a temporary is found out, not assumed:
# every rank creates the temporary (or finds it there) and drops its writer file, holding the save's token, into it;
# after a barrier each rank looks for the others' files, and the ranks that see each other form one *folder*, published
# by its lowest rank. Every publishing rank checks its own destination and free space first, and any refusal refuses on
# every rank; nothing is published until every rank has written its part, and rank 0's own files (DCP's ``.metadata``,
# ``meta.pt``) are copied into every other folder, so each one says which checkpoint it belongs to. A folder that lacks
# the other folders' shard files is refused at load as incomplete; copying every folder into one (as Ray's upload does)
# gives the complete checkpoint.
@contextmanager
def atomic_directory(
    final: str | os.PathLike,
    expected_bytes: int = 0,
    form: str = "sharded",
    collective: bool = True,
    rank0_files: Sequence[str] = (),
    group: dist.ProcessGroup | None = None,
) -> Iterator[Path]:
    """Yield a temporary folder beside this rank's ``final``; every folder is published once all ranks are done.

    A collective: every rank enters and leaves it, each with its own ``final`` (the same path on a shared disk, or
    each its own; see [Note: ranks that share no disk]). Every rank checks its own destination first (see
    ``destination.py``; a folder ``form``, "sharded" or "hf") and every rank raises any rank's refusal before
    anything is written. If any rank fails inside, every rank raises (a full disk anywhere as the "no space left"
    sentence) and the temporaries are removed: nothing is published and nothing is left behind. ``expected_bytes``
    is this rank's share. ``rank0_files``: names of files rank 0 writes that every published folder receives.
    ``collective=False``: one process writes the folder alone, whether or not it belongs to a process group.
    ``group``: the process group of every agreement (one spanning all ranks; the default group when None).
    """
    final = Path(final)
    ranks = Ranks.of(collective, group)
    _raise_first_refusal(ranks.gather(check_destination(final, form, expected_bytes)), ranks.rank)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(ranks.broadcast(temporary_sibling(final).name))
    writer = failure = None
    try:
        tmp.mkdir(exist_ok=True)
        writer = claim(tmp, ranks.rank, token=tmp.name)
    except OSError as err:
        failure = err
    try:
        ranks.barrier()  # every writer file is in place
        seen = _Folder.seen_in(tmp) if failure is None else None
        found = ranks.gather((_verdict(failure, ranks.rank, final, expected_bytes), seen))
        _raise_agreed([verdict for verdict, _ in found], ranks.rank, failure, final)
        folders = [folder for _, folder in found]
        _check_folders(folders, final)
        owner = folders[ranks.rank].owner
        folder_bytes = expected_bytes * folders[ranks.rank].size
        if owner == ranks.rank:
            remove_stale_temporaries(final)  # ours is held by its writers, so it stays
        _raise_first_refusal(
            ranks.gather(check_destination(final, form, folder_bytes) if owner == ranks.rank else None), ranks.rank
        )
        try:
            yield tmp
        except BaseException as err:
            failure = err
        _agree(ranks, failure, final, folder_bytes)
        if any(folder.owner != 0 for folder in folders):
            _agree(ranks, _attempt(lambda: _copy_rank0_files(tmp, ranks, owner, rank0_files)), final, folder_bytes)
        _agree(
            ranks, _attempt(lambda: _publish_owned(tmp, final) if owner == ranks.rank else None), final, folder_bytes
        )
    finally:
        delete_temporary(tmp)
        release(writer)


def refuse_on_every_rank(final: Path, form: str, expected_bytes: int, group: dist.ProcessGroup | None = None) -> None:
    """Every rank checks its own ``final`` (see ``check_destination``) and raises any rank's refusal (a collective):
    what ``atomic_directory`` checks first, for a caller that must know before it hands the save on."""
    ranks = Ranks.of(collective=True, group=group)
    _raise_first_refusal(ranks.gather(check_destination(final, form, expected_bytes)), ranks.rank)


def raise_on_every_rank(failure: BaseException | None, final: Path | str) -> None:
    """After a write only rank 0 did (a collective): every rank raises if rank 0's write failed, or none does.

    Rank 0 raises its own error; the others raise the same out-of-space sentence (``OSError(ENOSPC)``), or a sentence
    that names rank 0's error -- instead of waiting for rank 0 in the next collective.
    """
    ranks = Ranks.of(collective=True)
    verdict = ranks.broadcast(_verdict(failure, 0, final, 0) if ranks.rank == 0 else None)
    if verdict is None:
        return
    if failure is not None:
        raise failure
    if verdict.full is not None:
        raise OSError(errno.ENOSPC, verdict.full)
    raise RuntimeError(f"the save to {final} failed on rank 0 ({verdict.error}); nothing was saved.")
