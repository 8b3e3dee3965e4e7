"""One rank's memory against what it may use: the numbers that say whether a run is about to run out.

On CPU the figures are the process's: its peak and current resident set (``getrusage`` and ``/proc/self/statm``), which
include the Python runtime and torch's own, against the host's memory (the smaller of ``MemTotal`` and a cgroup
limit) divided among the ranks of the host. On CUDA they are the caching allocator's: the peak of allocated tensors
and the memory it reserved, against the device's total.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch

CGROUP_LIMIT = "/sys/fs/cgroup/memory.max"


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int
    resident_bytes: int
    limit_bytes: int


def read_memory(device: torch.device, ranks_on_host: int, limit_bytes: int | None = None) -> MemoryReading:
    """This rank's peak and resident bytes, and its share of the memory (``limit_bytes`` when given)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        resident = torch.cuda.memory_reserved(device)
        limit = limit_bytes or torch.cuda.get_device_properties(device).total_memory
        return MemoryReading(int(peak), int(resident), int(limit))
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux
    return MemoryReading(int(peak), _resident_bytes(), int(limit_bytes or host_memory() // max(ranks_on_host, 1)))


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best figure there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def host_memory() -> int:
    """The bytes this host's processes may use: physical memory, or less where a cgroup (a container) says so."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open(CGROUP_LIMIT) as limit:
            text = limit.read().strip()
    except OSError:
        return total
    return min(total, int(text)) if text.isdigit() else total
