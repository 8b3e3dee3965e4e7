"""Our Fully Sharded Data Parallel engine. Imports torch only: usable from plain torchrun, testable alone."""

from lightning_fsdp.engine.api import fully_shard
from lightning_fsdp.engine.build.policies import ModuleClassPolicy, SizeBasedPolicy, size_based_policy
from lightning_fsdp.engine.features.activation_checkpointing import apply_activation_checkpointing
from lightning_fsdp.engine.features.uneven_evaluation import uneven_batches
from lightning_fsdp.engine.init.materialize import meta_build
from lightning_fsdp.engine.optimizers import UpdateScope, declare_update_scope, prepare_optimizer
from lightning_fsdp.engine.options import BackwardPrefetch, CrossHostPrecision, MixedPrecision, ShardingStrategy
from lightning_fsdp.engine.state.clip import clip_grad_norm_, clip_grad_value_
from lightning_fsdp.engine.state.contexts import no_sync, set_requires_gradient_sync, summon_full_params
from lightning_fsdp.engine.state.release import release

__all__ = [
    "BackwardPrefetch",
    "CrossHostPrecision",
    "MixedPrecision",
    "apply_activation_checkpointing",
    "ModuleClassPolicy",
    "ShardingStrategy",
    "SizeBasedPolicy",
    "UpdateScope",
    "clip_grad_norm_",
    "clip_grad_value_",
    "declare_update_scope",
    "fully_shard",
    "meta_build",
    "no_sync",
    "prepare_optimizer",
    "release",
    "set_requires_gradient_sync",
    "size_based_policy",
    "summon_full_params",
    "uneven_batches",
]
