"""lightning_fsdp: Fully Sharded Data Parallel for PyTorch Lightning, on CPU and GPU.

Importing the package registers the strategy names ``"myfsdp"``, ``"myfsdp_shard_grad_op"`` and
``"myfsdp_cpu_offload"`` with Lightning's Trainer and with Fabric, so ``Trainer(strategy="myfsdp")`` and
``Fabric(strategy="myfsdp")`` work after ``import lightning_fsdp``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_fsdp.averaging import ShardedEMA
from lightning_fsdp.checkpoint.pretrained import load_pretrained
from lightning_fsdp.engine import (
    BackwardPrefetch,
    MixedPrecision,
    ShardingStrategy,
    apply_activation_checkpointing,
    clip_grad_norm_,
    clip_grad_value_,
    fully_shard,
    no_sync,
    set_requires_gradient_sync,
    size_based_policy,
    summon_full_params,
)
from lightning_fsdp.estimate import estimate_memory
from lightning_fsdp.fabric import FabricFSDPPrecision, FabricFSDPStrategy
from lightning_fsdp.precision import FSDPPrecision, ShardedGradScaler
from lightning_fsdp.strategy import FSDPStrategy

FSDPStrategy.register_strategies(StrategyRegistry)
FabricFSDPStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "BackwardPrefetch",
    "FabricFSDPPrecision",
    "FabricFSDPStrategy",
    "FSDPPrecision",
    "FSDPStrategy",
    "MixedPrecision",
    "ShardedEMA",
    "ShardedGradScaler",
    "ShardingStrategy",
    "apply_activation_checkpointing",
    "clip_grad_norm_",
    "clip_grad_value_",
    "estimate_memory",
    "fully_shard",
    "load_pretrained",
    "no_sync",
    "set_requires_gradient_sync",
    "size_based_policy",
    "summon_full_params",
]
