"""The collectives Lightning asks of a strategy (``sync_dist``'s reduction, barriers, broadcasts), waited for like the
engine's own: a rank stuck in one while a peer is in another collective raises within seconds instead of at the
process group's timeout, and SIGTERM ends the wait (see [Note: every wait knows where its peers are] in
``engine/diagnostics/hang_watch.py``). On NCCL they are Lightning's own calls, unchanged."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lightning_fsdp.engine.diagnostics.hang_watch import wait_work

_NUMBERS = itertools.count(1)  # every rank numbers these collectives alike, so two ranks in one share the number


def available() -> bool:
    """Whether there are other ranks to reduce with (a run of one process has none)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _watched(group: Any) -> bool:
    return dist.get_backend(group) == "gloo"


def _place(what: str) -> str:
    return f"the strategy's {what} #{next(_NUMBERS)}"


def reduce(
    tensor: torch.Tensor,
    group: Any | None,
    reduce_op: Any | None,
    what: str = "all-reduce (a logged value's sync_dist, or strategy.reduce)",
) -> torch.Tensor:
    """In place over ``group`` (None: every rank), as Lightning's ``_sync_ddp``: ``"mean"``/``"avg"``, ``"sum"``, ...
    or a ``ReduceOp``; gloo has no average, so it sums and divides. ``what``: the place a long wait posts."""
    group = dist.group.WORLD if group is None else group
    divide = False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        divide = name == "avg" and _watched(group)
        op = ReduceOp.SUM if divide else getattr(ReduceOp, name.upper())
    else:
        op = ReduceOp.SUM if reduce_op is None else reduce_op
    if not _watched(group):
        dist.all_reduce(tensor, op=op, group=group)
    else:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        wait_work(work, group, what=_place(what))
    if not divide:
        return tensor
    world_size = dist.get_world_size(group)
    return tensor.div_(world_size) if tensor.is_floating_point() else tensor.copy_(tensor / world_size)


def barrier(device: torch.device, name: str | None = None) -> None:
    if not _watched(None):
        dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
        return
    label = f"barrier '{name}'" if name else "barrier"
    wait_work(dist.barrier(async_op=True), None, what=_place(label))


def broadcast_object(obj: Any, src: int) -> Any:
    """``obj`` from rank ``src`` on every rank (pickled between the run's own ranks, as ``broadcast_object_list``)."""
    if not _watched(None):
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]
    place = _place(f"broadcast from rank {src}")
    sending = dist.get_rank() == src
    payload = bytearray(pickle.dumps(obj)) if sending else bytearray()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    wait_work(dist.broadcast(size, src, async_op=True), None, what=place)
    data = torch.frombuffer(payload, dtype=torch.uint8) if sending else torch.empty(int(size), dtype=torch.uint8)
    wait_work(dist.broadcast(data, src, async_op=True), None, what=place)
    return obj if sending else pickle.loads(data.numpy().tobytes())
