"""The one definition of the arguments the Trainer's and Fabric's strategies share: names, types and defaults.

Both ``FSDPStrategy`` and ``FabricFSDPStrategy`` take these arguments; each receives them through ``**arguments``
and publishes them in its signature (``publish_arguments``), so ``inspect.signature`` -- and with it LightningCLI,
which builds a config's fields from the signature -- sees every one with its type and default, while the list
exists here only. A strategy's own arguments (the ones Lightning fills in, and those only the Trainer has) stay in
its own ``__init__``.

The annotations are evaluated here (no postponed annotations), so the published signature carries the types
themselves rather than strings that would have to be resolved in another module.
"""

import inspect
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from enum import Enum
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp.engine import CrossHostPrecision, MixedPrecision

WrapPolicy = Callable[[nn.Module, bool, int], bool]
# str first and the callable last: jsonargparse tries the members in order, and then keeps class paths from a YAML
# config as strings (which the saved config.yaml can write back out) instead of importing them itself or reading one
# as "build a Block".
Policy = Iterable[str | type[nn.Module]] | str | type[nn.Module] | WrapPolicy | None
ShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


def strategy_arguments(
    *,
    process_group_backend: str | None = None,
    timeout: timedelta | None = default_pg_timeout,
    cpu_offload: bool | Any | None = None,
    mixed_precision: MixedPrecision | Any | None = None,
    auto_wrap_policy: Policy = None,
    activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
    activation_checkpointing_policy: Policy = None,
    sharding_strategy: ShardingName | Enum = "FULL_SHARD",
    state_dict_type: Literal["full", "sharded"] = "full",
    device_mesh: tuple[int, int] | DeviceMesh | None = None,
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST"] | Enum | None = "BACKWARD_PRE",
    forward_prefetch: bool | None = None,
    limit_all_gathers: bool = True,
    sync_module_states: bool = False,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    process_group: dist.ProcessGroup | None = None,
    ignored_modules: Iterable[nn.Module] | None = None,
    ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
    use_orig_params: bool = True,
    device_id: int | torch.device | None = None,
    trust_checkpoint: bool = False,
    storage_options: dict[str, Any] | None = None,
    async_save: bool = False,
    reshard_after_forward: bool | int | None = None,
    cross_host_precision: Literal["bf16", "int8"] | CrossHostPrecision | None = None,
    gather_embedding_by_rows: bool = True,
) -> dict[str, Any]:
    """Every shared argument by name, the defaults filled in where ``given`` lacks one. What each means is in
    ``FSDPStrategy``'s docstring; the checks are in ``ShardedModelSetup._set_sharding_arguments``."""
    return dict(locals())


ARGUMENTS: Mapping[str, inspect.Parameter] = inspect.signature(strategy_arguments).parameters


def publish_arguments(strategy: type) -> None:
    """Give ``strategy.__init__``'s signature the shared arguments, keyword-only, after its own, with the class's
    ``argument_defaults`` in place of the shared ones (Fabric saves sharded checkpoints by default, the Trainer one
    file). The function's ``**arguments`` is left out: a keyword outside the list is refused, so it belongs to no
    config."""
    init = strategy.__dict__["__init__"]
    defaults: Mapping[str, Any] = strategy.argument_defaults
    own = inspect.signature(init)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = [p.replace(default=defaults.get(name, p.default)) for name, p in ARGUMENTS.items()]
    init.__signature__ = own.replace(parameters=[*kept, *shared])
