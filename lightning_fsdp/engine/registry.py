"""Which modules are sharding units and which tensors are shards, without attaching attributes to either.

Weak maps keyed by identity: a model or parameter that is garbage-collected leaves nothing behind, and tensors are
never compared with ``==`` (which would be element-wise).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from lightning_fsdp.engine.param import FSDPParam
    from lightning_fsdp.engine.unit import FSDPUnit

_UNIT_OF_MODULE: WeakKeyDictionary[nn.Module, FSDPUnit] = WeakKeyDictionary()
_PARAM_OF_SHARD = WeakIdKeyDictionary()
_UNIT_OF_SHARD = WeakIdKeyDictionary()  # -> a weak reference to the unit: the unit holds the shard


def register_unit(unit: FSDPUnit) -> None:
    _UNIT_OF_MODULE[unit.module] = unit
    for fsdp_param in unit.params:
        _PARAM_OF_SHARD[fsdp_param.sharded] = fsdp_param
        _UNIT_OF_SHARD[fsdp_param.sharded] = weakref.ref(unit)


def unit_of(module: nn.Module) -> FSDPUnit | None:
    return _UNIT_OF_MODULE.get(module)


def units_under(module: nn.Module) -> list[FSDPUnit]:
    """Every unit in ``module``'s subtree, in module (pre-)order: parents before children."""
    return [unit for m in module.modules() if (unit := _UNIT_OF_MODULE.get(m)) is not None]


def unit_holding(fsdp_param: FSDPParam) -> FSDPUnit:
    """The unit that gathers and reduces ``fsdp_param``."""
    unit = _UNIT_OF_SHARD[fsdp_param.sharded]()
    assert unit is not None, f"{fsdp_param} outlived its unit"
    return unit


def fsdp_param_of(tensor: torch.Tensor) -> FSDPParam | None:
    """The sharded parameter a registered shard belongs to; None for anything the engine does not shard."""
    return _PARAM_OF_SHARD.get(tensor)
