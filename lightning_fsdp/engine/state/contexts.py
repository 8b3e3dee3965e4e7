"""Context managers around a sharded model: full parameters on demand, and skipping gradient sync."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.runtime.unit import TrainingState


@contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Gather every unit under ``module`` so its parameters are the full tensors inside the block.

    The full tensors are the master weights themselves, gathered in the shards' own dtype (fp32 under mixed
    precision, never ``param_dtype``), on the compute device; see [Note: summoned parameters are the masters] in
    ``param.py``. With ``writeback`` each rank copies its rows back into the shards on exit, so in-place edits
    (loading weights, re-initialising a layer) stick exactly, and a read-only look changes no bit. Without it, edits
    are discarded. A collective: call it on every rank, outside forward and backward, and do not nest it over the
    same modules.
    """
    units = units_under(module)
    busy = [u for u in units if u.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"summon_full_params was called during forward or backward ({busy[0]!r} is "
            f"{busy[0].training_state.name}); call it between training steps."
        )
    entered = []
    try:
        for unit in units:
            unit.summon()
            entered.append(unit)
        yield
    finally:
        with torch.no_grad():
            for unit in entered:
                unit.end_summon(writeback)


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient reduction of every unit under ``module`` off (accumulate locally) or back on.

    With sync off, each unit keeps its full, unreduced gradients across micro-batches (the memory of an unsharded
    model's gradients); the first backward with sync on reduces their sum once.
    """
    for unit in units_under(module):
        unit.set_requires_grad_sync(requires_gradient_sync)


@contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Skip gradient reduction for the backward passes inside the block (gradient accumulation's micro-batches)."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)
