"""What the Trainer's and Fabric's strategies share: reading the sharding arguments, and sharding a model with them.

:class:`~lightning_fsdp.FSDPStrategy` (``Trainer(strategy="myfsdp")``) and
:class:`~lightning_fsdp.FabricFSDPStrategy` (``Fabric(strategy="myfsdp")``) take the same arguments with the same
meaning and put a model on the engine the same way; :class:`ShardedModelSetup` is that common part, so a fix to an
argument's validation or to the default wrap policy reaches both. Each strategy adds its framework's side: the
Trainer's hooks, Fabric's ``setup_module``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_fsdp.adapter import watched_collectives
from lightning_fsdp.adapter.lightning_arguments import (
    activation_checkpointing_alias,
    refuse_unknown_keywords,
    split_ignored,
    torch_fsdp_keywords,
)
from lightning_fsdp.adapter.strategy_arguments import SHARED_ARGUMENTS, Policy, WrapPolicy
from lightning_fsdp.engine import CrossHostPrecision, MixedPrecision, apply_activation_checkpointing, fully_shard
from lightning_fsdp.engine.build.policies import (
    as_wrap_policy,
    module_classes,
    repeated_block_class,
    select_unit_modules,
)
from lightning_fsdp.engine.diagnostics.hang_watch import MainThreadWatch, watch_main_thread
from lightning_fsdp.engine.init.materialize import has_meta_tensors, track_meta_build
from lightning_fsdp.engine.options import (
    ShardingStrategy,
    parse_backward_prefetch,
    parse_cpu_offload,
    parse_reshard_after_forward,
    parse_sharding_strategy,
)
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.state.release import release

HYBRID_STRATEGIES = tuple(s.value for s in ShardingStrategy if s.is_hybrid)
WHOLE_MODEL = "whole_model"  # auto_wrap_policy: the whole model as one unit, on purpose
STATE_DICT_TYPES = ("full", "sharded")


class ShardedModelSetup(ABC):
    """The sharding arguments as attributes, and ``_setup_model``: ``fully_shard`` with them, in place.

    A mixin for a Lightning ``ParallelStrategy``, before it in the bases: it gives both strategies the same
    ``root_device``, ``num_nodes``, ``num_processes``, ``distributed_sampler_kwargs`` and ``process_group_backend``
    (from the base's ``parallel_devices``, ranks and ``world_size``); the strategy says where its precision plugin's
    engine policy comes from.
    """

    sharding_strategy: str
    mixed_precision: Any
    _hybrid_mesh: tuple[int, int] | DeviceMesh | None
    _watch: MainThreadWatch | None = None  # the run's, from the process group to the teardown

    # What the Lightning base class (``ParallelStrategy``) provides.
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    local_rank: int
    node_rank: int
    global_rank: int

    # ----- where and how many: the same for the Trainer and Fabric ---------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ----- the process group and the collectives Lightning asks for: the same for the Trainer and Fabric -----------

    def _set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Read back through the getter: some environments' setters are no-ops.
        rank_zero_only.rank = self.global_rank

    def _init_process_group(self) -> None:
        """Every rank's seed, then the process group with the strategy's ``timeout``, so every collective of the
        run -- the engine's included -- fails after that long instead of hanging on a dead rank."""
        reset_seed()
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._stop_watching()  # a run whose teardown never came (one strategy, several stages)
        self._watch = watch_main_thread(self)  # see [Note: every wait knows where its peers are]

    def _end_run(self, modules: Iterable[nn.Module]) -> None:
        """Give back what the run took (see [Note: what a run gives back] in ``engine/state/release.py``): the engine's
        resources of every model it sharded, which stay usable, and the thread it started. The process group stays
        for the next run, as Lightning leaves it after DDP. Safe to call again."""
        for module in modules:
            release(module)
        self._stop_watching()

    def _stop_watching(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            watched_collectives.barrier(self.root_device, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        return watched_collectives.broadcast_object(obj, src)

    @contextmanager
    def _meta_build(self) -> Generator[None, None, None]:
        """Modules built inside are created on the meta device, their init recorded for the replay at setup."""
        with torch.device("meta"), track_meta_build():
            yield

    def _set_sharding_arguments(self, shared: Mapping[str, Any], unknown: Mapping[str, Any]) -> None:
        """Check every shared argument (one sentence saying what to change) and keep it in the form the engine takes.

        ``shared``: the values of the strategy's keywords named in ``SHARED_ARGUMENTS``; ``unknown``: what its
        ``**kwargs`` received, refused with what to use instead.
        """
        refuse_unknown_keywords(dict(unknown))
        arguments = SimpleNamespace(**{name: shared[name] for name in SHARED_ARGUMENTS})
        self._num_nodes = 1
        self._hybrid_mesh = None  # fixed in setup_environment
        self._set_group_arguments(arguments)
        self._set_checkpoint_arguments(arguments)
        self.auto_wrap_policy = resolve_policy(arguments.auto_wrap_policy, "auto_wrap_policy")
        self.activation_checkpointing_policy = resolve_policy(
            activation_checkpointing_alias(
                arguments.activation_checkpointing, arguments.activation_checkpointing_policy
            ),
            "activation_checkpointing_policy",
        )
        self.mixed_precision = check_mixed_precision(arguments.mixed_precision)
        if arguments.param_init_fn is not None and not callable(arguments.param_init_fn):
            raise ValueError(f"param_init_fn must be a callable taking a module, got {arguments.param_init_fn!r}.")
        self.param_init_fn = arguments.param_init_fn
        self.cpu_offload = parse_cpu_offload(arguments.cpu_offload)
        self.forward_prefetch = (
            None if arguments.forward_prefetch is None else flag("forward_prefetch", arguments.forward_prefetch)
        )
        self.limit_all_gathers = flag("limit_all_gathers", arguments.limit_all_gathers)
        self.sync_module_states = flag("sync_module_states", arguments.sync_module_states)
        self.use_orig_params = flag("use_orig_params", arguments.use_orig_params)
        self.ignored_modules, self.ignored_params = split_ignored(arguments.ignored_modules, arguments.ignored_states)
        if arguments.device_id is not None and not isinstance(arguments.device_id, int | torch.device):
            raise ValueError(f"device_id must be a device index or a torch.device, got {arguments.device_id!r}.")
        self.device_id = arguments.device_id
        parse_reshard_after_forward(arguments.reshard_after_forward, parse_sharding_strategy(self.sharding_strategy))
        self.reshard_after_forward = arguments.reshard_after_forward
        self.cross_host_precision = CrossHostPrecision.coerce(arguments.cross_host_precision)
        self.gather_embedding_by_rows = flag("gather_embedding_by_rows", arguments.gather_embedding_by_rows)
        self.kwargs = torch_fsdp_keywords(
            {
                "auto_wrap_policy": arguments.auto_wrap_policy,
                "device_mesh": arguments.device_mesh,
                "process_group": arguments.process_group,
                "backward_prefetch": arguments.backward_prefetch,
                "forward_prefetch": arguments.forward_prefetch,
                "limit_all_gathers": arguments.limit_all_gathers,
                "sync_module_states": arguments.sync_module_states,
                "param_init_fn": arguments.param_init_fn,
                "device_id": arguments.device_id,
                "ignored_modules": arguments.ignored_modules,
                "ignored_states": arguments.ignored_states,
            },
            self.use_orig_params,
        )

    def _set_group_arguments(self, arguments: SimpleNamespace) -> None:
        """Which ranks shard, over what, and how long a collective may wait."""
        if arguments.process_group_backend is not None and not isinstance(arguments.process_group_backend, str):
            raise ValueError(
                f"process_group_backend must be a string such as 'gloo', got {arguments.process_group_backend!r}."
            )
        self._process_group_backend = arguments.process_group_backend
        if arguments.timeout is not None and not isinstance(arguments.timeout, timedelta):
            raise ValueError(
                f"timeout must be a datetime.timedelta (or None for torch's default), got {arguments.timeout!r}."
            )
        self._timeout = arguments.timeout
        self.sharding_strategy: str = parse_sharding_strategy(arguments.sharding_strategy).value
        prefetch = parse_backward_prefetch(arguments.backward_prefetch)
        self.backward_prefetch = None if prefetch is None else prefetch.value
        if arguments.process_group is not None and arguments.device_mesh is not None:
            raise ValueError(
                "process_group= and device_mesh= are mutually exclusive; pass the mesh alone for HYBRID_SHARD, or the "
                "process group alone to shard over its ranks."
            )
        self.process_group = check_process_group(arguments.process_group)
        self.device_mesh = check_device_mesh(arguments.device_mesh, self.sharding_strategy)

    def _set_checkpoint_arguments(self, arguments: SimpleNamespace) -> None:
        """How checkpoints are written and read."""
        if arguments.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type={arguments.state_dict_type!r} is not supported; use 'full' or 'sharded'."
            )
        self.state_dict_type = arguments.state_dict_type
        self.trust_checkpoint = flag("trust_checkpoint", arguments.trust_checkpoint)
        if arguments.storage_options is not None and not isinstance(arguments.storage_options, dict):
            raise TypeError(
                "storage_options must be a dict of the store's fsspec options, not a "
                f"{type(arguments.storage_options).__name__}."
            )
        self.storage_options = arguments.storage_options
        self.async_save = flag("async_save", arguments.async_save)

    @abstractmethod
    def _precision_engine_policy(self) -> MixedPrecision | None:
        """The engine's ``MixedPrecision`` that the strategy's precision plugin asks for (None: full precision)."""

    def _mesh_for_world(self) -> tuple[int, int] | DeviceMesh | None:
        """The HYBRID_SHARD layout, checked against the world size before any process group exists."""
        if self.sharding_strategy not in HYBRID_STRATEGIES:
            return None
        mesh = self.device_mesh if self.device_mesh is not None else (self.num_nodes, self.num_processes)
        shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else mesh
        if shape[0] * shape[1] != self.world_size:
            raise ValueError(
                f"device_mesh={shape} covers {shape[0] * shape[1]} ranks but this run has {self.world_size} "
                f"({self.num_nodes} node(s) x {self.num_processes} device(s)); choose (replicate, shard) sizes whose "
                f"product is {self.world_size}."
            )
        return mesh

    def _check_device_id(self) -> None:
        """torch's ``device_id`` names the device to shard on; here that is the rank's own device, so another is an
        error rather than silently ignored."""
        if self.device_id is None:
            return
        wanted = torch.device("cuda", self.device_id) if isinstance(self.device_id, int) else self.device_id
        if wanted != self.root_device:
            raise ValueError(
                f"device_id={self.device_id!r} differs from this rank's device {self.root_device}; leave device_id "
                "unset, the strategy shards every rank on its own device."
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place (names and structure unchanged), then apply activation checkpointing."""
        if self.param_init_fn is not None and not has_meta_tensors(model):
            rank_zero_warn(unused_param_init_fn(model))
        fully_shard(
            model,
            self._wrap_policy(model),
            sharding_strategy=self.sharding_strategy,
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            **self._engine_options(),
        )
        if self.activation_checkpointing_policy is not None:
            apply_activation_checkpointing(model, self.activation_checkpointing_policy)
        return model

    def _wrap_policy(self, model: nn.Module) -> WrapPolicy | set[type[nn.Module]] | None:
        """The policy the engine gets: the user's, or the model's repeated blocks when none was given (see
        :func:`default_policy`). A policy that selects no submodule leaves the root as the only unit, with a
        warning, as Lightning's FSDP trains such a model as one unit."""
        policy = self.auto_wrap_policy
        if policy == WHOLE_MODEL:
            return None
        if policy is None:
            return default_policy(model)
        ignored = {id(m) for root in self.ignored_modules for m in root.modules()}
        selected = select_unit_modules(
            model, as_wrap_policy(policy), lambda m: unit_of(m) is not None, lambda m: id(m) in ignored
        )
        if not selected:
            rank_zero_warn(
                f"the auto_wrap_policy {policy!r} selects no submodule of {type(model).__name__}, so the whole model "
                "is one unit, gathered whole in forward and backward; pass the classes of its repeated blocks to "
                f"shard it unit by unit, or auto_wrap_policy={WHOLE_MODEL!r} to silence this."
            )
            return None
        return policy

    def _engine_options(self) -> dict[str, Any]:
        """The engine options that are set away from their defaults; the engine's defaults stay its own."""
        options: dict[str, Any] = {}
        if (mixed_precision := self._engine_mixed_precision()) is not None:
            options["mixed_precision"] = mixed_precision
        if self.cpu_offload:
            options["cpu_offload"] = True
        if self._hybrid_mesh is not None:
            options["device_mesh"] = self._hybrid_mesh
        if self.process_group is not None:
            options["process_group"] = self.process_group
        if self.sync_module_states:
            options["sync_module_states"] = True
        if self.param_init_fn is not None:
            options["param_init_fn"] = self.param_init_fn
        if self.ignored_modules:
            options["ignored_modules"] = self.ignored_modules
        if self.ignored_params:
            options["ignored_params"] = self.ignored_params
        if self.reshard_after_forward is not None:
            options["reshard_after_forward"] = self.reshard_after_forward
        if self.cross_host_precision is not None:
            options["cross_host_precision"] = self.cross_host_precision
        if not self.gather_embedding_by_rows:
            options["gather_embedding_by_rows"] = False
        return options

    def _engine_mixed_precision(self) -> MixedPrecision | None:
        """The explicit ``mixed_precision`` (ours, or torch's read by field), else the precision plugin's policy."""
        if self.mixed_precision is not None:
            return MixedPrecision.coerce(self.mixed_precision)
        return self._precision_engine_policy()


def unused_param_init_fn(model: nn.Module) -> str:
    """Why ``param_init_fn`` is not called for ``model``: as in torch's FSDP, it initialises only modules materialised
    from the meta device, and ``configure_model`` builds on the real device unless an empty init is asked for."""
    return (
        f"param_init_fn is not called: no parameter or buffer of {type(model).__name__} is on the meta device, and, as "
        "in torch's FSDP, it initialises only modules materialised from there; build the model on the meta device "
        "(FSDPStrategy(empty_init=True) or trainer.init_module(empty_init=True) with the layers made in "
        "configure_model; under Fabric, fabric.init_module(empty_init=True)) or initialise it before setup."
    )


def default_policy(model: nn.Module) -> set[type[nn.Module]] | None:
    """With no ``auto_wrap_policy``, each of the model's repeated blocks becomes a unit.

    One unit for the whole model would gather all of it in forward and backward: more memory than DDP. The blocks
    (:func:`~lightning_fsdp.engine.build.policies.repeated_block_class`) are what a user would name; the choice is
    logged once per model class, with how to override it.
    """
    block = repeated_block_class(model)
    if (type(model), block) not in _REPORTED_DEFAULTS:
        _REPORTED_DEFAULTS.add((type(model), block))
        if block is None:
            rank_zero_info(
                f"FSDPStrategy: {type(model).__name__} has no repeated blocks holding most of its parameters, so it is "
                "sharded as one unit; pass auto_wrap_policy={YourBlock} to shard it unit by unit."
            )
        else:
            rank_zero_info(
                f"FSDPStrategy: no auto_wrap_policy given, so each {block.__module__}.{block.__qualname__} of "
                f"{type(model).__name__} becomes a sharding unit; pass auto_wrap_policy={{...}} to choose others, or "
                f"auto_wrap_policy={WHOLE_MODEL!r} for one unit."
            )
    return None if block is None else {block}


_REPORTED_DEFAULTS: set[tuple[type[nn.Module], type[nn.Module] | None]] = set()


def resolve_policy(policy: Policy, argument: str) -> WrapPolicy | set[type[nn.Module]] | str | None:
    """A policy as the engine takes it: None, a callable, or a set of module classes. Lightning's forms are adapted
    here (import paths from a config, ``WHOLE_MODEL``); the engine validates the rest (``module_classes``)."""
    if policy == WHOLE_MODEL:
        return policy
    if isinstance(policy, str):
        policy = [policy]
    if isinstance(policy, Iterable) and not isinstance(policy, nn.Module | type):
        policy = [_import_class(item, argument) if isinstance(item, str) else item for item in policy]
    classes = module_classes(policy, argument)
    return policy if classes is None else classes


def _import_class(path: str, argument: str) -> Any:
    module_name, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(
            f"{argument} names {path!r}, which does not import ({error}); give the full import path of an nn.Module "
            "class, such as 'lightning_fsdp.demos.gpt.Block'."
        ) from None


def flag(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{argument} must be True or False, got {value!r}.")
    return value


def check_device_mesh(device_mesh: object, sharding_strategy: str) -> tuple[int, int] | DeviceMesh | None:
    if device_mesh is None:
        return None
    if sharding_strategy not in HYBRID_STRATEGIES:
        raise ValueError(
            f"device_mesh={device_mesh!r} only applies to sharding_strategy='HYBRID_SHARD' (got "
            f"{sharding_strategy!r}); remove it or switch to HYBRID_SHARD."
        )
    if isinstance(device_mesh, DeviceMesh) and device_mesh.ndim == 2:
        return device_mesh
    if (
        isinstance(device_mesh, tuple | list)
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in device_mesh)
    ):
        return (device_mesh[0], device_mesh[1])
    raise ValueError(
        f"device_mesh={device_mesh!r} is not a (replicate, shard) pair of positive ints or a 2-D DeviceMesh; pass, "
        "say, (2, 4) for 2 replicas of a model sharded over 4 ranks."
    )


def check_mixed_precision(mixed_precision: object) -> Any:
    """Ours or torch's ``MixedPrecision``, kept as given (``mixed_precision_config`` returns it, as Lightning's does);
    the engine reads torch's fields when it shards."""
    try:
        MixedPrecision.coerce(mixed_precision)
    except TypeError:
        raise ValueError(
            f"mixed_precision must be a lightning_fsdp.MixedPrecision or torch.distributed.fsdp.MixedPrecision, got "
            f"{type(mixed_precision).__name__}; or leave it None and set Trainer(precision='bf16-mixed')."
        ) from None
    return mixed_precision


def check_process_group(process_group: object) -> dist.ProcessGroup | None:
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return process_group
    raise ValueError(
        f"process_group must be one torch.distributed.ProcessGroup, got {type(process_group).__name__}; for "
        "HYBRID_SHARD pass device_mesh=(replicate, shard) instead of a (shard, replicate) pair of groups."
    )


def check_optimizers_hold_shards(optimizers: list[Optimizer], module: nn.Module) -> None:
    """An optimizer built before sharding holds the full tensors the model no longer has: it would step nothing."""
    current = {id(param) for param in module.parameters()}
    for index, optimizer in enumerate(optimizers):
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in current]
        if stale:
            raise ValueError(
                f"optimizer {index} ({type(optimizer).__name__}) holds {len(stale)} tensors that are not the model's "
                f"parameters after sharding (the first has shape {tuple(stale[0].shape)}), so it was built before "
                "FSDPStrategy sharded the model; create it inside configure_optimizers from self.parameters()."
            )
