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
from weakref import WeakKeyDictionary, finalize

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

_REPLACED = WeakIdKeyDictionary()  # a parameter fully_shard replaced -> the name it had
_CHECKED: WeakKeyDictionary[torch.optim.Optimizer, int] = WeakKeyDictionary()  # -> parameters seen at the check
_LIVE: set[int] = set()  # ids of the replaced parameters not yet collected
_HOOK: list[RemovableHandle] = []  # the optimizer hook, while ``_LIVE`` is not empty


def record_replaced(param: nn.Parameter, name: str) -> None:
    """``param`` is no longer the module's: ``fully_shard`` registered its shard under ``name`` instead."""
    _REPLACED[param] = name
    if id(param) not in _LIVE:
        _LIVE.add(id(param))
        finalize(param, _forget, id(param))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced_params))


def _forget(param_id: int) -> None:
    """A replaced parameter was collected: no optimizer holds it; without any left, the hook goes."""
    _LIVE.discard(param_id)
    if not _LIVE and _HOOK:
        _HOOK.pop().remove()


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
