"""``FabricFSDPStrategy``: Lightning Fabric's ParallelStrategy on our engine, used as ``Fabric(strategy="myfsdp")``.

Fabric calls a strategy from the user's own loop; this one answers as follows.

- ``__init__``: the Trainer strategy's arguments, checked by the same code (``adapter/sharding_setup.py``), so a
  config moves between ``Trainer`` and ``Fabric`` unchanged; ``state_dict_type`` defaults to ``"sharded"``.
- ``setup_environment``: ranks, the HYBRID_SHARD mesh checked, the process group with the strategy's timeout.
- ``fabric.init_module(empty_init=True)``: modules on the meta device, materialized unit by unit when set up.
- ``fabric.setup(model, optimizer)``: ``fully_shard`` in place, names unchanged; an optimizer built before gets the
  shards put in place of the parameters they replaced, by name (refused once it has state).
- ``fabric.backward``, ``fabric.clip_gradients`` (the norm of the whole gradient), ``fabric.no_backward_sync``.
- ``fabric.save`` / ``load`` / ``load_raw``: a full file in Lightning Fabric's layout or the Trainer strategy's
  sharded folder (``fabric/checkpoint.py``), with the Trainer's refusal and safety rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from weakref import WeakSet

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.types import _PATH, Optimizable
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from lightning_fsdp.adapter import watched_collectives
from lightning_fsdp.adapter.sharding_setup import ShardedModelSetup
from lightning_fsdp.adapter.strategy_arguments import SHARED_ARGUMENTS, Policy, ShardingName
from lightning_fsdp.adapter.strategy_names import register_names
from lightning_fsdp.checkpoint.async_save import BackgroundSaver
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.rank_zero import refuse_full_destination, save_on_rank_zero
from lightning_fsdp.engine import (
    CrossHostPrecision,
    MixedPrecision,
    clip_grad_norm_,
    clip_grad_value_,
    no_sync,
    prepare_optimizer,
)
from lightning_fsdp.engine.diagnostics.hang_watch import set_phase
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.fabric.checkpoint import (
    FabricState,
    load_into,
    load_raw_module,
    load_raw_optimizer,
    restore_metadata,
    save_full,
    save_sharded_folder,
    sharded_folder_state,
    split_state,
)
from lightning_fsdp.fabric.precision import FabricFSDPPrecision, as_fabric_fsdp_precision

if TYPE_CHECKING:
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["FabricFSDPStrategy"]


class FabricFSDPStrategy(ShardedModelSetup, ParallelStrategy, _Sharded):
    """Fully Sharded Data Parallel for Lightning Fabric with our engine, on CPU (gloo) and CUDA (NCCL).

    Every argument means what it means for :class:`~lightning_fsdp.FSDPStrategy` (see there); the ones Fabric
    itself fills in are ``accelerator``, ``parallel_devices``, ``cluster_environment`` and ``precision`` (derived
    from ``Fabric(precision=...)``, see :mod:`lightning_fsdp.fabric.precision`).

    Args:
        state_dict_type: ``"sharded"`` (the default, as in Lightning Fabric's FSDP: one folder, every rank writing its
            rows) or ``"full"`` (one file gathered on rank 0). Either form loads in a Trainer with
            ``FSDPStrategy`` and the other way round.
        trust_checkpoint: let ``fabric.load`` unpickle more than plain data. Only for files you wrote yourself;
            ``fabric.load(..., weights_only=False)`` does the same for one load.
        storage_options: for checkpoints at fsspec URLs (``s3://bucket/ckpt``): the keywords of the store's fsspec
            file system (``{"endpoint_url": ..., "key": ..., "secret": ...}`` for s3fs), for ``fabric.save`` and
            ``fabric.load``. See ``checkpoint/remote.py``.
        async_save: write sharded checkpoints in the background while training goes on, as
            ``FSDPStrategy(async_save=True)`` does (``checkpoint/async_save.py``): ``fabric.save`` returns once this
            rank's part is copied to CPU memory; the next save waits for the write and raises its failure, as does
            ``fabric.strategy.teardown()``, which waits for the last write (the interpreter waits for it at exit too).
            Sharded, local paths only.
        **kwargs: refused, with a sentence. The other arguments are ``FSDPStrategy``'s, with the same meaning
            (``adapter/strategy_arguments.py``); ``strategy.kwargs`` holds the torch-FSDP keywords given, as
            Lightning's Trainer strategy keeps them (read-only).
    """

    strategy_name = "myfsdp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | Any | None = None,
        mixed_precision: MixedPrecision | Any | None = None,
        auto_wrap_policy: Policy = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: Policy = None,
        sharding_strategy: ShardingName | Enum = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
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
        **kwargs: Any,
    ) -> None:
        shared = {name: value for name, value in locals().items() if name in SHARED_ARGUMENTS}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._set_sharding_arguments(shared, kwargs)
        if self.async_save and self.state_dict_type != "sharded":
            raise ValueError(
                "async_save=True writes sharded checkpoints in the background; pass state_dict_type='sharded' as well "
                "(a full file is gathered on rank 0 and written there), or drop async_save."
            )
        self._background: BackgroundSaver | None = None  # made at the first background save
        self._backward_sync_control = _EngineBackwardSyncControl()
        self._sharded_modules: WeakSet[nn.Module] = WeakSet()
        # A parameter fully_shard replaced -> (its module, its name), to give an optimizer built before the shards.
        self._replaced = WeakIdKeyDictionary()
        self._optimizer_steps = 0  # what a long wait says this rank was doing: see ``optimizer_step``

    # ----- precision and checkpoint plugins -------------------------------------------------------------------------

    @property
    @override
    def precision(self) -> FabricFSDPPrecision:
        plugin = self._precision
        return plugin if isinstance(plugin, FabricFSDPPrecision) else FabricFSDPPrecision("32-true")

    @precision.setter
    @override
    def precision(self, precision: Precision | None) -> None:
        # Fabric hands over the plugin it built from Fabric(precision=...); an unsupported one fails here.
        self._precision = None if precision is None else as_fabric_fsdp_precision(precision)

    @property
    def mixed_precision_config(self) -> Any:
        """As Lightning's: the explicit ``mixed_precision`` as given, else the precision plugin's dtypes."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        return self.precision.mixed_precision_config

    @override
    def _precision_engine_policy(self) -> MixedPrecision | None:
        return self.precision.engine_mixed_precision

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(
            f"{type(self).__name__} writes its checkpoints itself (atomically, in the sharded or full form); it has no "
            "CheckpointIO plugin."
        )

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO) -> None:
        raise ValueError(
            f"{type(self).__name__} writes its checkpoints itself (atomically, in the sharded or full form) and takes "
            f"no CheckpointIO plugin; remove {type(io).__name__} from Fabric(plugins=...)."
        )

    # ----- processes and the process group --------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        self._hybrid_mesh = self._mesh_for_world()
        self._init_process_group()
        self.precision.device = self.root_device.type

    # ----- models and optimizers ------------------------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: modules on the meta device, materialized and initialized unit by unit at setup (peak
        memory: one unit). Otherwise they are created on the CPU, as with Lightning's FSDP, and reach the device at
        setup, so weights set at construction survive."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(self._meta_build())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """Deliberately nothing: the engine shards a built model in ``setup_module`` (a meta-device build is
        ``init_module(empty_init=True)``'s)."""
        return nullcontext()

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Move the real tensors; meta-device ones stay for the engine to materialize unit by unit."""
        device = self.root_device
        module._apply(lambda t: t if t.is_meta else t.to(device))

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: LRScheduler | None = None
    ) -> tuple[nn.Module, list[Optimizer], LRScheduler | None]:
        """Shard ``module``, then put its shards into the optimizers in place of the parameters they replaced."""
        for optimizer in optimizers:
            _refuse_stepped(optimizer)
        module = self.setup_module(module)
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (names and structure unchanged), then apply activation checkpointing."""
        self._check_device_id()
        if unit_of(module) is not None:
            return module
        before = dict(module.named_parameters(remove_duplicate=False))
        self.module_to_device(module)
        self._setup_model(module)
        after = dict(module.named_parameters(remove_duplicate=False))
        for name, old in before.items():
            if after.get(name) is not old:
                self._replaced[old] = after[name]
        self._sharded_modules.add(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer with every parameter ``fully_shard`` replaced swapped for that parameter's shard, prepared
        for the shards (what it reads of each decides where it lives; see ``engine/optimizers/prepare.py``)."""
        stale = [p for group in optimizer.param_groups for p in group["params"] if p in self._replaced]
        if stale:
            _refuse_stepped(optimizer)
            for group in optimizer.param_groups:
                group["params"] = [self._replaced.get(param, param) for param in group["params"]]
        prepare_optimizer(optimizer)  # before its first step: see [Note: an optimizer is prepared ...] in prepare.py
        return optimizer

    # ----- the step -------------------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The step, then the count of steps as this rank's phase: a Fabric loop has no loop state of its own for us
        to read, and a rank that waits where a peer cannot come (its data ended sooner) then names how far each got
        (see [Note: every wait knows where its peers are] in ``engine/diagnostics/hang_watch.py``)."""
        output = super().optimizer_step(optimizer, **kwargs)
        self._optimizer_steps += 1
        set_phase(f"training, {self._optimizer_steps} optimizer steps done")
        return output

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of the whole, unsharded gradient (each rank holds only its rows of it)."""
        self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        return clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(list(self.precision.main_params(optimizer)), clip_val)

    # ----- collectives ----------------------------------------------------------------------------------------------

    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return watched_collectives.reduce(tensor, group, reduce_op) if watched_collectives.available() else tensor
        return tensor

    # ----- checkpoints ----------------------------------------------------------------------------------------------

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``state`` as one full file (gathered on rank 0) or one sharded folder, atomically.

        The destination is checked on rank 0 before anything is gathered: a save replaces only a checkpoint of the
        same form, and every rank raises the same refusal.
        """
        path = self.broadcast(str(path))
        if storage_options is not None and not is_remote(path):
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint takes storage_options only for a URL (s3://...), not {path}."
            )
        path = path if is_remote(path) else Path(path)
        storage_options = {**(self.storage_options or {}), **(storage_options or {})} if is_remote(path) else None
        parts = split_state(state)
        if self.state_dict_type == "sharded" and self.async_save:
            if is_remote(path):
                raise ValueError(
                    f"asynchronous sharded saves write to local paths only, not {path}; save to a local folder, or "
                    "drop async_save to save to a store."
                )
            if self._background is None:
                self._background = BackgroundSaver(self._timeout)
            self._background.save(path, *sharded_folder_state(parts, filter or {}))
            return
        if self.state_dict_type == "sharded":
            save_sharded_folder(path, parts, filter or {}, storage_options)
            return
        refuse_full_destination(path, storage_options=storage_options)
        save_on_rank_zero(path, lambda: save_full(path, parts, filter or {}, self.is_global_zero, storage_options))

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint (either form, written by Fabric or by a Trainer) into ``state``; return what is left.

        Nothing but plain data is unpickled unless trusted: ``fabric.load(..., weights_only=False)`` or
        ``FabricFSDPStrategy(trust_checkpoint=True)`` (an explicit ``weights_only=True`` wins over the latter).
        """
        if self._background is not None:
            self._background.wait()  # a checkpoint still being written is loaded once complete
        path = self.broadcast(str(path))
        path = path if is_remote(path) else Path(path)
        trust = weights_only is False or (weights_only is None and self.trust_checkpoint)
        opt_in = "fabric.load(..., weights_only=False) or FabricFSDPStrategy(trust_checkpoint=True)"
        if isinstance(state, nn.Module):
            load_raw_module(path, state, strict, trust, opt_in)
            return {}
        if isinstance(state, Optimizer):
            load_raw_optimizer(path, self._module_of(state), state, trust, opt_in)
            return {}
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs the objects to restore, as "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...}); a sharded model cannot be handed "
                "back as one dictionary."
            )
        parts: FabricState = split_state(state)
        remainder = load_into(path, parts, strict, trust, opt_in, self.storage_options)
        restore_metadata(remainder, parts, state)
        return remainder

    def _module_of(self, optimizer: Optimizer) -> nn.Module:
        """The set-up module whose shards ``optimizer`` steps (``load_raw`` of an optimizer needs their names)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in self._sharded_modules:
            if any(id(p) in params for p in module.parameters()):
                return module
        raise ValueError(
            "the optimizer steps no model set up by this Fabric; call fabric.setup(model, optimizer) before "
            "fabric.load_raw(path, optimizer)."
        )

    @override
    def teardown(self) -> None:
        """Give back what the run took (see [Note: what a run gives back] in ``engine/state/release.py``): the engine's
        shared memory and buffers of every model set up here, the thread watching the main thread, the plugins. The
        models stay where they are, their shards in memory of their own, usable. Fabric itself never calls this: without
        it all of that goes with the models and this strategy, once they are garbage-collected.

        A background save still in flight is waited for, and its failure raised once everything is released."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        failure = self._background.close() if self._background is not None else None
        self._end_run(list(self._sharded_modules))
        set_phase(None)
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()
        if failure is not None:
            raise failure

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls)


class _EngineBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the engine keeps the full, unreduced gradients until a backward outside."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if unit_of(module) is None:
            raise TypeError(
                f"no_backward_sync needs the model set up by fabric.setup (sharded); got {type(module).__name__}, "
                "which is not."
            )
        return no_sync(module)


def _refuse_stepped(optimizer: Optimizer) -> None:
    """An optimizer that already has state holds it for the full tensors: it cannot move onto the shards."""
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already has state (it has stepped) for the model's parameters before "
            "sharding, which cannot move onto the shards; create it afresh before fabric.setup(model, optimizer), "
            "or after fabric.setup_module(model) from model.parameters()."
        )


FabricFSDPStrategy.register_strategies(STRATEGY_REGISTRY)  # the registry's entries for our names: this class
