"""A rank with no batch left takes part in its peers' evaluation forward without computing anything.

``serve_forward`` runs the collectives of one evaluation forward of the sharded model and nothing else
(see [Note: serving the peers' forward], above it); ``uneven_batches`` wraps an evaluation loop's batches so that a rank
whose batches ran out serves its peers until every rank's have. The Trainer's strategy does the same in
``trainer/uneven_data.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp.engine.diagnostics.hang_watch import wait_work
from lightning_fsdp.engine.runtime.hooks import context_of, post_forward, pre_forward
from lightning_fsdp.engine.runtime.registry import unit_of

Batch = TypeVar("Batch")


# [Note: serving the peers' forward] Under DDP a forward has no collective, so ranks whose evaluation data ends at
# different points finish on their own. Here every unit's forward gathers its parameters from every rank: a rank whose
# loop has ended must still send its shards, or its peers wait for it forever. ``serve_forward`` runs the hooks of one
# evaluation forward of the sharded model with no inputs and no module code: the root's, then for each unit the last
# evaluation forward of this rank entered (``RootContext.evaluation_units``, the order the gathers were issued in), its
# pre-forward (the gather, and whatever prefetch the real forward does) and post-forward (the reshard). So the
# collectives, their order, their stamps and their sizes are those of a real forward, one unit's memory at a time, and
# the stamps still check that they are: a peer whose forward enters other units (a branch on the data) raises
# ``CollectiveMismatchError`` instead of reading the wrong unit's data. A rank that has run no evaluation forward yet
# serves the forward order of training, or the units in the order they were registered.
#
# The caller decides how many forwards to serve: before every evaluation batch the ranks exchange how many of them still
# have one (``ranks_with_batch``; the Trainer's strategy in ``trainer/uneven_data.py``, a loop of one's own, under
# Fabric or the engine alone, through ``uneven_batches``).
def serve_forward(module: nn.Module) -> None:
    """The collectives of one evaluation forward of ``module`` (a root of ``fully_shard``), computing nothing."""
    root = unit_of(module)
    if root is None:
        raise ValueError(f"serve_forward takes a module sharded by fully_shard; {type(module).__name__} is not.")
    with torch.no_grad():
        pre_forward(root, root.module, (), {})
        context = context_of(root)
        order = list(context.evaluation_units) or [u for u in context.forward_order or context.units if u is not root]
        for unit in order:
            pre_forward(unit, unit.module, (), {})
            post_forward(unit, unit.module, (), None)
        post_forward(root, root.module, (), None)


def uneven_batches(model: nn.Module, batches: Iterable[Batch]) -> Iterator[Batch]:
    """This rank's ``batches`` for an evaluation loop whose ranks may have different numbers of them (per-rank shards,
    streaming data): when they run out here, this rank serves its peers' forwards of ``model`` (sends its shards, runs
    nothing) until every rank's batches have run out, so the loop ends on every rank together, each with its own
    batches' results, as under DDP. A collective per batch (one integer, all-reduced) and one at the end: every
    rank must iterate it, with ``torch.no_grad()`` forwards of ``model``, one a batch. ``model`` is the module
    ``fully_shard`` sharded, or a wrapper of it that holds it as ``.module`` (Fabric's); a module that is not sharded
    has nothing to serve (DDP's forward needs no peer), so the same loop runs under any strategy. See [Note: serving
    the peers' forward]."""
    sharded = _sharded_root(model)
    device = next(model.parameters(), torch.empty(0)).device
    for batch in batches:
        ranks_with_batch(1, device)
        yield batch
    while ranks_with_batch(0, device) > 0:
        if sharded is not None:
            serve_forward(sharded)


def _sharded_root(model: nn.Module) -> nn.Module | None:
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, nn.Module) and unit_of(candidate) is not None:
            return candidate
    return None


def ranks_with_batch(has_batch: int, device: torch.device) -> int:
    """How many ranks run an evaluation step now (this one says ``has_batch``): a collective over every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return has_batch
    flag = torch.tensor([has_batch], dtype=torch.int64, device=device)
    work = dist.all_reduce(flag, async_op=True)
    if device.type == "cpu":
        wait_work(work, None, what="the count of ranks with an evaluation batch (uneven_batches)")
    else:
        work.wait()
    return int(flag.item())
