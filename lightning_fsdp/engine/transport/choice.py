"""Which transport a process group uses: chosen alike on every rank, and logged once with the reason (see
[Note: one transport per group] in ``base.py``)."""

from __future__ import annotations

import logging

import torch
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.transport.base import Transport
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.nccl import NcclTransport
from lightning_fsdp.engine.transport.shm import SharedMemoryTransport
from lightning_fsdp.engine.transport.single_rank import SingleRank

log = logging.getLogger(__name__)


def standalone_transport(group: ProcessGroup | None, device: torch.device) -> Transport:
    """The transport ``group`` can always use, without asking the other ranks: NCCL for CUDA tensors, else gloo."""
    if group is None or group.size() == 1:
        return SingleRank(None)
    if device.type == "cuda":
        return NcclTransport(group, device)
    return GlooTransport(group)


def choose_transport(group: ProcessGroup | None, device: torch.device, send_bytes: dict[str, int]) -> Transport:
    """The fastest transport every rank of ``group`` can use, chosen alike on every rank (a collective when shared
    memory is tried), and logged once with the reason no faster one was available.

    ``send_bytes``: the largest send buffer of each collective kind the units will issue over ``group`` (what the
    shared-memory slots must hold).
    """
    if group is None or group.size() == 1:
        return SingleRank(None)
    if device.type == "cuda":
        chosen, reason = standalone_transport(group, device), "CUDA tensors: the fastest there is"
    else:
        shared, reason = SharedMemoryTransport.create(group, send_bytes)
        chosen = shared if shared is not None else standalone_transport(group, device)
    log.info("lightning_fsdp: %s transport over %d ranks (%s)", chosen.name, chosen.world_size, reason)
    return chosen
