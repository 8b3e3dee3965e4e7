"""Which modules are sharding units and which tensors are shards, without attaching attributes to either.

Weak maps keyed by identity: a model or parameter that is garbage-collected leaves nothing behind, and tensors are
never compared with ``==`` (which would be element-wise).

The values are weak too. A unit holds its module and an ``FSDPParam`` its shard, so a strong value would keep its own
weak key alive for as long as the map, the process: every model ever sharded, and with it the shared-memory segment
its shards live in. What keeps a unit alive is its module, whose forward hooks hold it (``hooks.install_hooks``), and
the unit holds its ``FSDPParam``s: both live exactly as long as the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary, ref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from lightning_fsdp.engine.runtime.param import FSDPParam
    from lightning_fsdp.engine.runtime.unit import FSDPUnit

_UNIT_OF_MODULE: WeakKeyDictionary[nn.Module, ref[FSDPUnit]] = WeakKeyDictionary()
_PARAM_OF_SHARD = WeakIdKeyDictionary()  # shard -> ref[FSDPParam]
_UNIT_OF_SHARD = WeakIdKeyDictionary()  # shard -> ref[FSDPUnit]


def register_unit(unit: FSDPUnit) -> None:
    _UNIT_OF_MODULE[unit.module] = ref(unit)
    for fsdp_param in unit.params:
        _PARAM_OF_SHARD[fsdp_param.sharded] = ref(fsdp_param)
        _UNIT_OF_SHARD[fsdp_param.sharded] = ref(unit)


def unit_of(module: nn.Module) -> FSDPUnit | None:
    found = _UNIT_OF_MODULE.get(module)
    return found() if found is not None else None


def units_under(module: nn.Module) -> list[FSDPUnit]:
    """Every unit in ``module``'s subtree, in module (pre-)order: parents before children."""
    return [unit for m in module.modules() if (unit := unit_of(m)) is not None]


def unit_holding(fsdp_param: FSDPParam) -> FSDPUnit:
    """The unit that gathers and reduces ``fsdp_param``."""
    unit = _UNIT_OF_SHARD[fsdp_param.sharded]()
    assert unit is not None, f"{fsdp_param} outlived its unit"
    return unit


def fsdp_param_of(tensor: torch.Tensor) -> FSDPParam | None:
    """The sharded parameter a registered shard belongs to; None for anything the engine does not shard."""
    found = _PARAM_OF_SHARD.get(tensor)
    return found() if found is not None else None
