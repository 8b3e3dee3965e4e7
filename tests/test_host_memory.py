"""A CPU step's freed memory stays in the process: allocating it again costs no page faults.

See [Note: freed memory stays with the process] in lightning_fsdp/engine/host_memory.py. malloc's thresholds are the
process's, so this runs in the fresh rank processes of a real 2-rank group, never in the test process.
"""

from __future__ import annotations

import os
import resource

import torch
from torch import nn

from lightning_fsdp import fully_shard
from lightning_fsdp.engine.features import host_memory
from tests.distributed import run_distributed

CHURN_TENSORS = 4
CHURN_NUMEL = 6 << 20  # 24 MB of fp32 each: under glibc's largest mmap threshold; 96 MB in all, over its trim's
PAGE_BYTES = resource.getpagesize()


def _refill_faults() -> int:
    """Page faults of allocating and filling ``CHURN_TENSORS`` large tensors after the same were allocated and freed
    before: what a step in a steady run pays for taking again the memory the previous step freed. The fewest of four
    such refills: one may still place a tensor elsewhere, around a small allocation made meanwhile (once in about
    thirty runs two of the four faulted in again); memory given back to the kernel faults in on every refill."""
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(CHURN_NUMEL) for _ in range(CHURN_TENSORS)]
        del tensors
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(faults[1:])


def _model() -> nn.Module:
    """50 MB of parameters: a step of it may free 100 MB, more than glibc keeps by itself."""
    return nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(3)))


def _check_freed_memory_kept(rank: int, world_size: int) -> None:
    pages = CHURN_TENSORS * CHURN_NUMEL * 4 // PAGE_BYTES
    os.environ[host_memory.ENV_SWITCH] = "0"
    fully_shard(_model())
    assert host_memory.keep_freed_memory(model_bytes=1 << 30) == 0, "malloc was changed while switched off"
    del os.environ[host_memory.ENV_SWITCH]
    fully_shard(_model())
    kept = _refill_faults()
    assert kept < pages // 20, f"{kept} of {pages} pages faulted in again after fully_shard on CPU"
    retained = host_memory.keep_freed_memory(model_bytes=1)
    assert retained >= 2 * sum(p.numel() * 4 for p in _model().parameters()), "a smaller model lowered the bound"


def test_freed_host_memory_is_reused_without_page_faults() -> None:
    run_distributed(_check_freed_memory_kept, 2)
