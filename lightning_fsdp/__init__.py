"""lightning_fsdp: Fully Sharded Data Parallel for PyTorch Lightning, on CPU and GPU.

Importing the package registers the strategy names ``"myfsdp"``, ``"myfsdp_shard_grad_op"`` and
``"myfsdp_cpu_offload"`` with Lightning's Trainer and with Fabric, so ``Trainer(strategy="myfsdp")`` and
``Fabric(strategy="myfsdp")`` work after ``import lightning_fsdp``. It does so without importing Lightning itself
(see ``adapter/registration.py``): the engine, ``lightning_fsdp.engine``, needs torch only, and what needs Lightning
here (the strategies, the precision plugins, the EMA callback) is imported on first use.

The layout, one folder per layer: ``engine/`` (the FSDP engine, torch only; ``engine/transport/`` moves the bytes),
``adapter/`` (what the two Lightning adapters share), ``trainer/`` (the Trainer's strategy), ``fabric/`` (Fabric's),
``checkpoint/`` (formats, safety, storage), ``averaging/`` (EMA), ``monitor/`` (where a step and the memory go),
``report/`` (the monitor's records as a page), ``runtime/`` (processes), ``demos/`` (the demo GPT and data),
``cli.py`` with ``estimate.py`` (the command line).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_fsdp.adapter.registration import register_when_lightning_loads
from lightning_fsdp.engine import (
    BackwardPrefetch,
    CrossHostPrecision,
    MixedPrecision,
    ShardingStrategy,
    UpdateScope,
    apply_activation_checkpointing,
    clip_grad_norm_,
    clip_grad_value_,
    declare_update_scope,
    fully_shard,
    meta_build,
    no_sync,
    prepare_optimizer,
    release,
    set_requires_gradient_sync,
    size_based_policy,
    summon_full_params,
    uneven_batches,
)

if TYPE_CHECKING:
    from lightning_fsdp.adapter.precision import ShardedGradScaler
    from lightning_fsdp.averaging import ShardedEMA
    from lightning_fsdp.checkpoint.pretrained import load_pretrained
    from lightning_fsdp.estimate import estimate_memory
    from lightning_fsdp.fabric import FabricFSDPPrecision, FabricFSDPStrategy
    from lightning_fsdp.monitor import FSDPMonitor
    from lightning_fsdp.trainer.precision import FSDPPrecision
    from lightning_fsdp.trainer.strategy import FSDPStrategy

# Exports whose modules import Lightning: loaded when first asked for.
_LAZY = {
    "FabricFSDPPrecision": "lightning_fsdp.fabric",
    "FabricFSDPStrategy": "lightning_fsdp.fabric",
    "FSDPMonitor": "lightning_fsdp.monitor",
    "FSDPPrecision": "lightning_fsdp.trainer.precision",
    "FSDPStrategy": "lightning_fsdp.trainer.strategy",
    "ShardedEMA": "lightning_fsdp.averaging",
    "ShardedGradScaler": "lightning_fsdp.adapter.precision",
    "estimate_memory": "lightning_fsdp.estimate",
    "load_pretrained": "lightning_fsdp.checkpoint.pretrained",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_fsdp' has no attribute {name!r}")


register_when_lightning_loads()

__all__ = [
    "BackwardPrefetch",
    "CrossHostPrecision",
    "FabricFSDPPrecision",
    "FabricFSDPStrategy",
    "FSDPMonitor",
    "FSDPPrecision",
    "FSDPStrategy",
    "MixedPrecision",
    "ShardedEMA",
    "ShardedGradScaler",
    "ShardingStrategy",
    "UpdateScope",
    "apply_activation_checkpointing",
    "clip_grad_norm_",
    "clip_grad_value_",
    "declare_update_scope",
    "estimate_memory",
    "fully_shard",
    "load_pretrained",
    "meta_build",
    "no_sync",
    "prepare_optimizer",
    "release",
    "set_requires_gradient_sync",
    "size_based_policy",
    "summon_full_params",
    "uneven_batches",
]
