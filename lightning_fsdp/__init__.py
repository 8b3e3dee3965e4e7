"""lightning_fsdp: Fully Sharded Data Parallel for PyTorch Lightning, on CPU and GPU."""

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

__all__ = [
    "BackwardPrefetch",
    "MixedPrecision",
    "ShardingStrategy",
    "apply_activation_checkpointing",
    "clip_grad_norm_",
    "clip_grad_value_",
    "fully_shard",
    "no_sync",
    "set_requires_gradient_sync",
    "size_based_policy",
    "summon_full_params",
]
