"""Keeping the host memory a CPU training step frees for the next step, instead of giving it back to the kernel.

``keep_freed_memory`` fixes glibc malloc's thresholds once per process, so the pages a step frees are reused by the next
step's allocations of the same sizes instead of being returned and faulted in again:
see [Note: freed memory stays with the process], above it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

ENV_SWITCH = "LIGHTNING_FSDP_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
MIN_RETAINED_BYTES = 64 << 20  # what glibc's own trim threshold grows to at most
MAX_RETAINED_BYTES = 2**31 - 1  # mallopt takes a C int

_retained = 0  # the trim threshold this process set so far (0: malloc untouched)


def _glibc_mallopt() -> ctypes._CFuncPtr | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


# [Note: freed memory stays with the process] A sharded CPU step frees, and the next step allocates again, every unit's
# unsharded parameters and full gradients, and autograd's own temporaries of the same sizes (an embedding's gradient is
# a fresh zero-filled tensor of its whole table). glibc's malloc gives memory back to the kernel as soon as more than
# ``M_TRIM_THRESHOLD`` is free at the top of its heap, and serves every allocation above ``M_MMAP_THRESHOLD`` with an
# ``mmap`` that its ``free`` unmaps; both thresholds grow with the largest block freed so far, to at most 64 and 32 MiB.
# A step that frees more than that at once (a language model's embedding and head alone can) hands its pages back, and
# the next step takes every one of them again as a page fault that zero-fills it. PyTorch's CPU tuning guide answers
# this with jemalloc or tcmalloc preloaded; the same effect from inside the process is to fix both thresholds: blocks of
# up to 32 MiB (the most glibc accepts) come from the heap, and a trim leaves ``M_TOP_PAD`` of free memory at its top
# (without it, a trim gives back everything above the threshold once a step frees more, activations included), to be
# reused by the next step's allocations of the same sizes.
#
# The peak resident memory is unchanged (what stays free is what the step's peak already took, and the next step takes
# it again), but the resident memory no longer falls between steps. Tensors above 32 MiB are still mapped and unmapped
# each time. The setting is the process's, so it is made once and only ever raised;
# ``LIGHTNING_FSDP_KEEP_FREED_MEMORY=0`` leaves malloc as it was. Other C libraries (musl, macOS) are left alone.
def keep_freed_memory(model_bytes: int) -> int:
    """Let up to twice ``model_bytes`` (at least 64 MiB, at most 2 GiB) of freed memory stay in the process (see the
    Note); returns the bytes now kept (0 where switched off or not glibc). ``model_bytes``: the model's parameters,
    unsharded; a step frees and allocates again at most every one of them and its gradient."""
    global _retained
    wanted = min(max(2 * model_bytes, MIN_RETAINED_BYTES), MAX_RETAINED_BYTES)
    if os.environ.get(ENV_SWITCH, "1") == "0" or wanted <= _retained:
        return _retained
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return 0
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, wanted), (M_TOP_PAD, wanted))
    if not all(mallopt(parameter, value) for parameter, value in settings):
        log.debug("lightning_fsdp: glibc refused the malloc thresholds; freed memory goes back to the kernel")
        return _retained
    _retained = wanted
    log.debug("lightning_fsdp: up to %d MB of freed host memory stays in the process between steps", wanted >> 20)
    return wanted
