"""Which transport a process group uses: chosen alike on every rank, and logged once with the reason (see
[Note: one transport per group] in ``base.py``)."""

from __future__ import annotations

import logging

import torch
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.options import CrossHostPrecision
from lightning_fsdp.engine.transport.base import Transport
from lightning_fsdp.engine.transport.compressed import link_transport
from lightning_fsdp.engine.transport.gloo import GlooTransport
from lightning_fsdp.engine.transport.hierarchical import HierarchicalTransport
from lightning_fsdp.engine.transport.hosts import HostLayout
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


def choose_transport(
    group: ProcessGroup | None,
    device: torch.device,
    send_bytes: dict[str, int],
    cross_host_precision: CrossHostPrecision | None = None,
    shard_homes: tuple[tuple[int, ...], ...] = (),
) -> Transport:
    """The fastest transport every rank of ``group`` can use, chosen alike on every rank (a collective: the ranks'
    hosts are compared, see [Note: host identity] in ``hosts.py``), and logged once with the reason no faster one was
    available.

    ``send_bytes``: the largest send buffer of each collective kind the units will issue over ``group`` (what the
    shared-memory slots must hold). ``cross_host_precision``: what crosses between hosts in fewer bits.
    ``shard_homes``: the bytes of each shard of each unit, for shared memory to keep (see [Note: shards that live in
    shared memory] in ``transport/shm/homes.py``).
    """
    if group is None or group.size() == 1:
        return SingleRank(None)
    if device.type == "cuda":
        chosen, reason = standalone_transport(group, device), "CUDA tensors: the fastest there is"
        if cross_host_precision is not None:
            reason += "; cross_host_precision applies to CPU ranks (gloo) only, NCCL moves every bit"
        log.info("lightning_fsdp: %s transport over %d ranks (%s)", chosen.name, chosen.world_size, reason)
        return chosen
    layout = HostLayout.of(group)
    if layout.single_host:
        shared, reason = SharedMemoryTransport.create(group, send_bytes, shard_homes)
        chosen = shared if shared is not None else standalone_transport(group, device)
    elif layout.host_major and (layout.ranks_per_host or 0) > 1:
        chosen = HierarchicalTransport.create(group, layout, send_bytes, cross_host_precision)
        reason = f"{layout.describe()}: see [Note: two stages] in transport/hierarchical.py"
    else:
        chosen = link_transport(group, cross_host_precision)
        reason = layout.describe()
        if layout.ranks_per_host != 1:
            reason += ": not the same number of ranks on every host, each host's in a row, so one flat group"
    log.info("lightning_fsdp: %s transport over %d ranks (%s)", chosen.name, chosen.world_size, reason)
    return chosen
