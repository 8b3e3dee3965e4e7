"""Context managers around a sharded model: full parameters on demand, and skipping gradient sync."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_fsdp.engine.registry import units_under
from lightning_fsdp.engine.unit import TrainingState


@contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True) -> Iterator[None]:
    """Gather every unit under ``module`` so its parameters are the full tensors inside the block.

    With ``writeback`` the values are copied back into the shards on exit, so in-place edits (loading weights,
    re-initialising a layer) stick. A collective: call it on every rank, outside forward and backward.
    """
    units = units_under(module)
    busy = [u for u in units if u.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"summon_full_params was called during forward or backward ({busy[0]!r} is "
            f"{busy[0].training_state.name}); call it between training steps."
        )
    with torch.no_grad():
        for unit in units:
            unit.unshard()
        for unit in units:
            unit.wait_for_unshard()
    try:
        yield
    finally:
        with torch.no_grad():
            for unit in units:
                if writeback:
                    for fsdp_param in unit.params:
                        fsdp_param.write_back_from_unsharded()
                unit.reshard()


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
