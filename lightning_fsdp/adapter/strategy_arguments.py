"""What the Trainer's and Fabric's strategies share of their arguments: the names, and the types they are written
with.

``FSDPStrategy`` and ``FabricFSDPStrategy`` each write every shared argument in their own ``__init__``, as Lightning's
strategies do, so that ``inspect.signature`` -- and with it LightningCLI, which builds a config's fields from the
signature -- sees each with its type and default; ``tests/test_layout.py`` checks that both list the same ones, with
the same types and defaults (but ``state_dict_type``'s: one file for the Trainer, a folder for Fabric, as in
Lightning). ``ShardedModelSetup._set_sharding_arguments`` checks them all.
"""

from collections.abc import Callable, Iterable
from typing import Literal

from torch import nn

WrapPolicy = Callable[[nn.Module, bool, int], bool]
# str first and the callable last: jsonargparse tries the members in order, and then keeps class paths from a YAML
# config as strings (which the saved config.yaml can write back out) instead of importing them itself or reading one
# as "build a Block".
Policy = Iterable[str | type[nn.Module]] | str | type[nn.Module] | WrapPolicy | None
ShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]

SHARED_ARGUMENTS = (
    "process_group_backend",
    "timeout",
    "cpu_offload",
    "mixed_precision",
    "auto_wrap_policy",
    "activation_checkpointing",
    "activation_checkpointing_policy",
    "sharding_strategy",
    "state_dict_type",
    "device_mesh",
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "sync_module_states",
    "param_init_fn",
    "process_group",
    "ignored_modules",
    "ignored_states",
    "use_orig_params",
    "device_id",
    "trust_checkpoint",
    "storage_options",
    "async_save",
    "reshard_after_forward",
    "cross_host_precision",
    "gather_embedding_by_rows",
)
