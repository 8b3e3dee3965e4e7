"""A rank with no batch left takes part in its peers' evaluation forward without computing anything.

[Note: serving the peers' forward] Under DDP a forward has no collective, so ranks whose evaluation data ends at
different points finish on their own. Here every unit's forward gathers its parameters from every rank: a rank whose
loop has ended must still send its shards, or its peers wait for it forever. ``serve_forward`` runs the hooks of one
evaluation forward of the sharded model with no inputs and no module code: the root's, then for each unit the last
evaluation forward of this rank entered (``RootContext.evaluation_units``, the order the gathers were issued in),
its pre-forward (the gather, and whatever prefetch the real forward does) and post-forward (the reshard). So the
collectives, their order, their stamps and their sizes are those of a real forward, one unit's memory at a time, and
the stamps still check that they are: a peer whose forward enters other units (a branch on the data) raises
``CollectiveMismatchError`` instead of reading the wrong unit's data.

The caller decides how many forwards to serve (the strategy exchanges, before every evaluation batch, how many ranks
still have one: ``trainer/uneven_data.py``). A rank that has run no evaluation forward yet serves the forward order of
training, or the units in the order they were registered.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_fsdp.engine.hooks import context_of, post_forward, pre_forward
from lightning_fsdp.engine.registry import unit_of


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
