"""Refuse an optimizer that still holds parameters as they were before ``fully_shard`` replaced them.

``fully_shard`` registers a new parameter (this rank's shard) under each name, so an optimizer built before it holds
tensors the model no longer reads: its ``step()`` would update them and change nothing the model computes, and
training would go on silently untrained. A global optimizer pre-step hook looks at every optimizer's parameters once,
and again whenever their number changes (``add_param_group``), and raises at the first ``step()`` that would be such
a no-op. It is there only while some replaced parameter lives (only an optimizer can still hold one): installed when
``fully_shard`` replaces the first, removed when the last is garbage-collected, so that nothing of ours stays in the
steps of every optimizer of the process once the models are gone.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_fsdp.engine.optimizers.step_hook import HookWhileAlive

_REPLACED = WeakIdKeyDictionary()  # a parameter fully_shard replaced -> the name it had
_CHECKED: WeakKeyDictionary[torch.optim.Optimizer, int] = WeakKeyDictionary()  # -> parameters seen at the check


def record_replaced(param: nn.Parameter, name: str) -> None:
    """``param`` is no longer the module's: ``fully_shard`` registered its shard under ``name`` instead."""
    _REPLACED[param] = name
    _STEP_HOOK.watch(param)


def _refuse_replaced_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = _REPLACED.get(param)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the parameter '{name}' as it was before fully_shard replaced "
                    "it with this rank's shard, so step() would update a tensor the model no longer uses; build the "
                    "optimizer after fully_shard, from model.parameters()."
                )
    _CHECKED[optimizer] = count


_STEP_HOOK = HookWhileAlive(_refuse_replaced_params)
