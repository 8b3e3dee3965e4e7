"""The memory a shared-memory transport moves bytes through: one anonymous memory file per rank, mapped by every
rank of the host, and a range of it mapped once more as a storage of its own (a shard that lives there).

[Note: segment lifetime] A segment is an anonymous memory file (``memfd_create``), never a file in ``/dev/shm``:
other ranks open it through ``/proc/<pid>/fd/<fd>`` of its creator, and the creator closes that descriptor as soon
as every rank has mapped it. The memory then lives exactly as long as the processes that map it, and a rank killed
at any moment -- before the others mapped its segment included -- leaves nothing behind for anyone to clean up. It
is allocated in full when it is created (``SLOTS``: three gather slots and two reduction slots, each of at most
``LIGHTNING_FSDP_CHUNK_MIB``, see [Note: chunks]), so running out of memory is a refusal at creation (every rank
falls back to gloo), not a SIGBUS mid-training. A run gives it back before the process ends: at the run's teardown
the units' shards move out of their homes into memory of their own and the transport unmaps everything (``close``),
so a sweep of many fits in one process holds no segment between fits (see [Note: what a run gives back] in
``engine/state/release.py``). A view of a home kept past that (a tensor of a sharded state dict) keeps its mapping, and
with it the whole segment's memory, until it is dropped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from datetime import timedelta

import torch
from torch.distributed import ProcessGroup

ENV_SWITCH = "LIGHTNING_FSDP_SHARED_MEMORY"
SEGMENT_NAME = "lightning_fsdp"  # how the segments show in /proc/<pid>/maps: "/memfd:lightning_fsdp-<pid> (deleted)"

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo, when a group does not say its own


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def reserve(nbytes: int) -> int | None:
    """A new anonymous memory file with all its memory allocated now (its descriptor); None if that fails.

    A sparse file would take its pages only as collectives first write them: running out of memory then kills the
    process with SIGBUS in the middle of training. Allocating up front turns that into a refusal here, on the rank
    that ran out, before any rank depends on the transport. See [Note: segment lifetime].
    """
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is None:  # not Linux
        return None
    try:
        fd = memfd_create(f"{SEGMENT_NAME}-{os.getpid()}", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        return None
    return fd


def map_file(path: str, nbytes: int) -> torch.Tensor:
    """The memory file at ``path`` (``/proc/<pid>/fd/<fd>``) mapped shared: writes are seen by every mapper.

    Never an inference tensor, though the first forward may run under Lightning's ``inference_mode`` (validation):
    training writes into these slots outside it, where an inference tensor accepts in-place writes only under
    ``no_grad``.
    """
    with torch.inference_mode(False):
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def peer_segment(path: str, nbytes: int, token: bytes) -> torch.Tensor | None:
    """Another rank's segment, if this rank sees the very memory that rank wrote its token to."""
    try:
        segment = map_file(path, nbytes)
    except RuntimeError:  # another host, or another pid namespace: no such process here, or no access to it
        return None
    return segment if bytes(segment[: len(token)].tolist()) == token else None


PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_range(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of the memory file ``fd`` (page-aligned ``offset``), mapped shared as a
    uint8 tensor whose storage is exactly those bytes, unmapped once nothing holds it. Python's own ``mmap`` would
    keep a duplicate of ``fd`` open for as long (see [Note: segment lifetime]), ``torch.from_file`` maps a file
    from its start only."""
    address = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if address in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes of a shared-memory segment failed")
    # A memoryview, unlike a ctypes array, can carry the finalizer; the tensor holds it, so unmapping waits for it.
    mapped = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    weakref.finalize(mapped, _LIBC.munmap, address, nbytes)
    with torch.inference_mode(False):  # see _map
        return torch.frombuffer(mapped, dtype=torch.uint8)


def timeout_of(group: ProcessGroup) -> timedelta:
    """The timeout ``group`` was created with (what its gloo collectives wait at most), read from its gloo backend."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):  # a torch that keeps it elsewhere
        return DEFAULT_TIMEOUT
