"""``FSDPStrategy``: Lightning's ParallelStrategy on top of our engine, used as ``Trainer(strategy="myfsdp")``.

The Trainer calls a strategy in a fixed order; this one fills the steps in as follows.

- ``__init__``: every argument checked, with one sentence that says what to change: Lightning's own arguments and
  the torch-FSDP keywords it forwards (read in ``lightning_arguments.py``). Class-path strings in the policies are
  imported here, so a YAML typo fails at once.
- ``setup_environment``: ranks from Lightning's cluster environment (its subprocess launcher, torchrun, SLURM, ...),
  the HYBRID_SHARD mesh checked against the world size, then ``init_process_group`` with the strategy's timeout, so
  every collective of the run -- the engine's included -- fails after that long instead of hanging.
- ``configure_model`` runs on the CPU with real weights (``model_sharded_context``), on the meta device only when an
  empty init was asked for.
- ``setup``: dtype conversion (precision plugin), sync batchnorm, the move to the device, ``fully_shard`` in place
  with the user's policy or the model's repeated blocks; only then the optimizers, which therefore hold the shards.
  A later stage (``validate`` after ``fit``) reuses the sharded model.
- ``training_step`` and the other steps: always through Lightning's forward redirection (see ``_redirect``).
- ``block_backward_sync``: gradient accumulation, reducing every micro-batch unless told otherwise.
- Checkpoints: one full file from rank 0 or one sharded folder from every rank (``lightning_fsdp/checkpoint``).
"""

from __future__ import annotations

import errno
import importlib
import inspect
from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.checkpoint.atomic import check_destination, remove, tensor_bytes
from lightning_fsdp.checkpoint.full import full_optimizer_state, load_full_checkpoint, mark_trainable_only
from lightning_fsdp.checkpoint.sharded import load_sharded, save_sharded
from lightning_fsdp.checkpoint_io import atomic_checkpoint_io
from lightning_fsdp.engine import MixedPrecision, apply_activation_checkpointing, fully_shard, no_sync
from lightning_fsdp.engine.deferred_init import track_meta_build
from lightning_fsdp.engine.options import (
    ShardingStrategy,
    parse_backward_prefetch,
    parse_cpu_offload,
    parse_sharding_strategy,
)
from lightning_fsdp.engine.policies import as_wrap_policy, module_classes, repeated_block_class, select_unit_modules
from lightning_fsdp.engine.registry import unit_of
from lightning_fsdp.engine.state_dict import full_state_dict, sharded_optimizer_state_dict, sharded_state_dict
from lightning_fsdp.lightning_arguments import activation_checkpointing_alias, refuse_unknown_keywords, split_ignored
from lightning_fsdp.precision import FSDPPrecision, as_fsdp_precision
from lightning_fsdp.registration import register
from lightning_fsdp.summary import use_full_size_summaries
from lightning_fsdp.sync_batchnorm import for_device

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.utilities.types import STEP_OUTPUT

WrapPolicy = Callable[[nn.Module, bool, int], bool]
# Strings first: a config parser (LightningCLI's jsonargparse) tries the members in order, and would otherwise take
# a class path for a callable to instantiate.
# str first and the callable last: jsonargparse then keeps class paths from a YAML config as strings (which the
# saved config.yaml can write back out) instead of importing them itself or reading one as "build a Block".
Policy = Iterable[str | type[nn.Module]] | str | type[nn.Module] | WrapPolicy | None
ShardingName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]

HYBRID_STRATEGIES = tuple(s.value for s in ShardingStrategy if s.is_hybrid)
WHOLE_MODEL = "whole_model"  # auto_wrap_policy: the whole model as one unit, on purpose
STATE_DICT_TYPES = ("full", "sharded")


class FSDPStrategy(ParallelStrategy):
    """Fully Sharded Data Parallel training with our engine, on CPU (gloo) and CUDA (NCCL).

    The arguments keep the names of Lightning's own ``FSDPStrategy`` where they mean the same, so moving over is one
    import or one ``class_path``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every Lightning
            strategy; the Trainer fills them in. ``precision_plugin`` is normally derived from
            ``Trainer(precision=...)`` (see :mod:`lightning_fsdp.precision`).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default NCCL on CUDA, gloo otherwise.
        timeout: how long any collective may wait before the run fails (a dead rank must not hang the others).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory: True, False, None
            (off) or torch's ``CPUOffload(offload_params=...)``.
        mixed_precision: an explicit ``MixedPrecision``, ours or torch's ``torch.distributed.fsdp.MixedPrecision``
            (its fields are read); by default derived from ``Trainer(precision=...)``.
        auto_wrap_policy: which modules become sharding units: a set of module classes, their import paths as
            strings (``"lightning_fsdp.demos.gpt.Block"``, for YAML configs), or a callable
            ``(module, recurse, nonwrapped_numel) -> bool`` (torch's policies, ``ModuleWrapPolicy`` included). None
            (the default): the model's repeated blocks, found and logged at setup; ``"whole_model"``: one unit. A
            policy that selects nothing leaves the whole model one unit, with a warning.
        activation_checkpointing: deprecated, as in Lightning: the classes of ``activation_checkpointing_policy``.
        activation_checkpointing_policy: which modules recompute their activations in backward; same forms.
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"`` or
            ``"_HYBRID_SHARD_ZERO2"`` (SHARD_GRAD_OP inside each shard group), or torch's enum members.
        state_dict_type: ``"full"`` (one file, gathered on rank 0) or ``"sharded"`` (one folder).
        device_mesh: ``(replicate, shard)`` sizes, or a 2-D ``DeviceMesh``, for ``HYBRID_SHARD`` only; by default
            shard within a node and replicate across nodes.
        backward_prefetch: ``"BACKWARD_PRE"``, ``"BACKWARD_POST"`` or None.
        forward_prefetch: gather the next unit in forward order ahead of time.
        limit_all_gathers: at most two units gathered ahead of their use.
        sync_module_states: broadcast rank 0's parameters and buffers at setup.
        param_init_fn: initializes a module materialized from the meta device, instead of its
            ``reset_parameters()``.
        process_group: the ranks to shard over (torch's keyword); the whole world by default.
        ignored_modules, ignored_states: modules (and, in ``ignored_states``, parameters) left whole on every rank,
            their gradients not reduced, as with torch's FSDP.
        use_orig_params: accepted for Lightning configs; our parameters always keep their names and identity.
        device_id: accepted when it names this rank's own device (where the strategy shards anyway).
        empty_init: build ``configure_model``'s modules on the meta device, materialized unit by unit in setup
            (lowest peak memory; initialization by ``reset_parameters()`` or ``param_init_fn``). By default
            ``configure_model`` runs on the real device, as in Lightning.
        sync_grads_each_micro_batch: with ``accumulate_grad_batches > 1``, reduce-scatter every micro-batch's
            gradients (the default: memory stays sharded) or, when False, keep the full unreduced gradients until the
            last micro-batch and reduce once (less communication, the gradient memory of an unsharded model).
        trust_checkpoint: let checkpoints this strategy loads unpickle more than plain data (tensors, numbers,
            strings, containers, paths). Only for files you wrote yourself: unpickling can run code from the file.
            Off by default; ``trainer.fit(..., weights_only=False)`` does the same for one load.
        save_trainable_only: checkpoints hold only the parameters that require gradients (and, as always, the
            optimizer state, which only they have): an adapter's few MB instead of the whole model. Resuming from one
            leaves the other parameters as the model has them -- build it with its base weights first.
        **kwargs: anything else is refused with a sentence: the torch-FSDP keywords Lightning forwards are all
            named arguments above.
    """

    strategy_name = "myfsdp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        sync_module_states: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        process_group: dist.ProcessGroup | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        ignored_states: Iterable[nn.Module | nn.Parameter] | None = None,
        use_orig_params: bool = True,
        device_id: int | torch.device | None = None,
        empty_init: bool = False,
        sync_grads_each_micro_batch: bool = True,
        trust_checkpoint: bool = False,
        save_trainable_only: bool = False,
        **kwargs: Any,
    ) -> None:
        refuse_unknown_keywords(kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise ValueError(f"process_group_backend must be a string such as 'gloo', got {process_group_backend!r}.")
        self._process_group_backend = process_group_backend
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta (or None for torch's default), got {timeout!r}.")
        self._timeout = timeout
        self.sharding_strategy: str = parse_sharding_strategy(sharding_strategy).value
        prefetch = parse_backward_prefetch(backward_prefetch)
        self.backward_prefetch = None if prefetch is None else prefetch.value
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not supported; use 'full' or 'sharded'.")
        self.state_dict_type = state_dict_type
        if process_group is not None and device_mesh is not None:
            raise ValueError(
                "process_group= and device_mesh= are mutually exclusive; pass the mesh alone for HYBRID_SHARD, or the "
                "process group alone to shard over its ranks."
            )
        self.process_group = _check_process_group(process_group)
        self.device_mesh = _check_device_mesh(device_mesh, self.sharding_strategy)
        self.auto_wrap_policy = resolve_policy(auto_wrap_policy, "auto_wrap_policy")
        self.activation_checkpointing_policy = resolve_policy(
            activation_checkpointing_alias(activation_checkpointing, activation_checkpointing_policy),
            "activation_checkpointing_policy",
        )
        self.mixed_precision = _check_mixed_precision(mixed_precision)
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"param_init_fn must be a callable taking a module, got {param_init_fn!r}.")
        self.param_init_fn = param_init_fn
        self.cpu_offload = parse_cpu_offload(cpu_offload)
        self.forward_prefetch = _flag("forward_prefetch", forward_prefetch)
        self.limit_all_gathers = _flag("limit_all_gathers", limit_all_gathers)
        self.sync_module_states = _flag("sync_module_states", sync_module_states)
        self.use_orig_params = _flag("use_orig_params", use_orig_params)
        self.empty_init = _flag("empty_init", empty_init)
        self.sync_grads_each_micro_batch = _flag("sync_grads_each_micro_batch", sync_grads_each_micro_batch)
        self.ignored_modules, self.ignored_params = split_ignored(ignored_modules, ignored_states)
        if device_id is not None and not isinstance(device_id, int | torch.device):
            raise ValueError(f"device_id must be a device index or a torch.device, got {device_id!r}.")
        self.device_id = device_id
        self._hybrid_mesh: tuple[int, int] | DeviceMesh | None = None  # fixed in setup_environment
        self.trust_checkpoint = _flag("trust_checkpoint", trust_checkpoint)
        self.save_trainable_only = _flag("save_trainable_only", save_trainable_only)
        self._atomic_io: tuple[CheckpointIO, CheckpointIO] | None = None  # (the plugin, it made atomic)

    # ----- where and how many ---------------------------------------------------------------------------------------

    @property
    @override
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
    def is_distributed(self) -> bool:
        """True: Lightning asks strategies it does not know for this, and then gives each rank its own slice of the
        data (a ``DistributedSampler``) and lets ``self.log(..., sync_dist=True)`` reduce across ranks."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ----- precision ------------------------------------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> FSDPPrecision:
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, FSDPPrecision) else FSDPPrecision("32-true")

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Lightning hands over the plugin it built from Trainer(precision=...); an unsupported one fails here, while
        # the Trainer is being constructed.
        self._precision_plugin = None if precision_plugin is None else as_fsdp_precision(precision_plugin)

    @property
    def mixed_precision_config(self) -> Any:
        """As Lightning's: the explicit ``mixed_precision`` as given (ours or torch's), else the precision plugin's
        dtypes (see :attr:`FSDPPrecision.mixed_precision_config`)."""
        if self.mixed_precision is not None:
            return self.mixed_precision
        return self.precision_plugin.mixed_precision_config

    # ----- processes and the process group --------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()
        self._hybrid_mesh = self._mesh_for_world()
        super().setup_environment()
        reset_seed()
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (called by the Trainer too)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Read back through the getter: some environments' setters are no-ops.
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

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

    # ----- sharding the model ---------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._check_device_id()
        if unit_of(self._module()) is None:
            self.model = self.precision_plugin.convert_module(self._module())
            if self._layer_sync is not None:
                self.model = for_device(self._layer_sync, self.root_device).apply(self.model)
            self.model_to_device()
            self.model = self._setup_model(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.device = self.root_device.type
        use_full_size_summaries(trainer)

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

    @override
    def model_to_device(self) -> None:
        """Move the model to its device before sharding: the engine shards a module where it lies. Tensors on the
        meta device (deferred init) stay there for the engine to materialize unit by unit on the current device;
        the real ones next to them (metric states built in ``__init__``, say) move now."""
        device = self.root_device
        self._module()._apply(lambda t: t if t.is_meta else t.to(device))

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` in place (names and structure unchanged), then apply activation checkpointing."""
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
        :func:`_default_policy`). A policy that selects no submodule leaves the root as the only unit, with a
        warning, as Lightning's FSDP trains such a model as one unit."""
        policy = self.auto_wrap_policy
        if policy == WHOLE_MODEL:
            return None
        if policy is None:
            return _default_policy(model)
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
        return options

    def _engine_mixed_precision(self) -> MixedPrecision | None:
        """The explicit ``mixed_precision`` (ours, or torch's read by field), else the precision plugin's policy."""
        if self.mixed_precision is not None:
            return MixedPrecision.coerce(self.mixed_precision)
        return self.precision_plugin.engine_mixed_precision

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        _check_optimizers_hold_shards(self.optimizers, self._module())

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` (``trainer.init_module(empty_init=True)``) creates modules on the meta device: no
        memory until setup materializes them unit by unit. Otherwise they are created on the CPU, as with Lightning's
        FSDP, and reach the device in setup. (``configure_model`` also runs inside this, with ``empty_init=None``.)"""
        with self._meta_build() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs inside this: on the real device as in Lightning's FSDP, so weights set there
        (a custom init, pretrained weights) survive sharding; on the meta device only with ``empty_init=True``."""
        with self._meta_build() if self.empty_init else nullcontext():
            yield

    @contextmanager
    def _meta_build(self) -> Generator[None, None, None]:
        with torch.device("meta"), track_meta_build():
            yield

    # ----- the steps ------------------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.train_step_context():
            return self._redirect("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._redirect("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._redirect("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._redirect("predict_step", *args, **kwargs)

    def _redirect(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` of the LightningModule as if it were its ``forward``.

        The LightningModule is the root unit: its forward hooks gather the parameters no block owns (embeddings, the
        final norm) and arm the backward bookkeeping. Since the model is sharded in place, ``self.model`` *is* the
        LightningModule and the base class would call the step directly, skipping those hooks.
        """
        module = self._module()
        return self._forward_redirection(module, module, method_name, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every micro-batch but the last of an accumulation. By default it does nothing,
        so each micro-batch is reduce-scattered and gradient memory stays sharded; with
        ``sync_grads_each_micro_batch=False`` it skips the reduction until the last micro-batch."""
        with nullcontext() if self.sync_grads_each_micro_batch else no_sync(self._module()):
            yield

    # ----- collectives for the Trainer ------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over the ranks (``"mean"`` or ``"sum"`` or a ``ReduceOp``); non-tensors pass through."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----- checkpoints ----------------------------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the sharded model: a model built on the meta device has nothing to load into before."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """``load_checkpoint`` loads the optimizers itself, straight into the shards (either form)."""
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full tensors gathered unit by unit to rank 0's CPU ({} elsewhere), or DTensors aliasing the shards; with
        ``save_trainable_only``, only the parameters that require gradients."""
        module = self._module()
        state = sharded_state_dict(module) if self.state_dict_type == "sharded" else full_state_dict(module)
        if not self.save_trainable_only:
            return state
        trainable = {name for name, param in module.named_parameters(remove_duplicate=False) if param.requires_grad}
        return {name: value for name, value in state.items() if name in trainable}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.state_dict_type == "sharded":
            return sharded_optimizer_state_dict(self._module(), optimizer)
        return full_optimizer_state(self._module(), optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write atomically: one file from rank 0, or one folder (DCP shards from every rank plus ``meta.pt``).

        Either way the destination is checked first, on rank 0 and for every rank: a save replaces only a checkpoint
        of the same form and refuses anything else (a user's folder, a foreign file) before a byte is written. The
        full file goes through the ``checkpoint_io`` plugin made atomic (see ``checkpoint_io.py``; with
        ``AsyncCheckpointIO`` it appears when the background write is complete).
        """
        if self.save_trainable_only:
            mark_trainable_only(checkpoint)
        if self.state_dict_type == "sharded":
            state = {"model": checkpoint.pop("state_dict")}
            for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{index}"] = optimizer_state
            save_sharded(filepath, state, checkpoint)
            return
        refusal = None
        if self.is_global_zero:
            refusal = check_destination(Path(filepath), "full", tensor_bytes(checkpoint))
        refusal = self.broadcast(refusal)
        if refusal is not None:
            raise OSError(errno.ENOSPC, refusal) if refusal.startswith("no space") else FileExistsError(refusal)
        if self.is_global_zero:
            self._atomic_checkpoint_io().save_checkpoint(checkpoint, filepath, storage_options)

    def _atomic_checkpoint_io(self) -> CheckpointIO:
        """``self.checkpoint_io`` made atomic, built once per plugin (an async one keeps its background thread)."""
        io = self.checkpoint_io
        if self._atomic_io is None or self._atomic_io[0] is not io:
            self._atomic_io = (io, atomic_checkpoint_io(io))
        return self._atomic_io[1]

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model (and, when fitting, optimizer) states into the shards; return the rest of the checkpoint.

        A folder is a sharded checkpoint (any world size); a file is a full one -- ours, ddp's or a single
        device's. Everything is checked before anything is loaded, and nothing but plain data is unpickled unless
        the user trusts the file: ``trainer.fit(..., weights_only=False)`` or ``FSDPStrategy(trust_checkpoint=True)``
        (an explicit ``weights_only=True`` wins over the latter).
        """
        module = self._module()
        optimizers = self.optimizers if module.trainer.state.fn == TrainerFn.FITTING else []
        weights_only = weights_only if weights_only is not None else _weights_only_given_to_the_trainer()
        trust = weights_only is False or (weights_only is None and self.trust_checkpoint)
        opt_in = "trainer.fit(..., weights_only=False) or FSDPStrategy(trust_checkpoint=True)"
        path = Path(checkpoint_path)
        if path.is_dir():
            return load_sharded(path, module, optimizers, module.strict_loading, trust, opt_in)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint at {path}; pass a .ckpt file or a sharded checkpoint folder.")
        return load_full_checkpoint(path, module, optimizers, module.strict_loading, trust, opt_in)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Deliberately nothing: ``load_checkpoint`` already loaded the model, straight into the shards."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Deliberately nothing: ``load_checkpoint`` already loaded the optimizers."""

    # ----- the end --------------------------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """Release the plugins, but leave the model where it is (unlike the base class, which moves it to the CPU):
        its parameters are shards tied to the engine's buffers, and ``.cpu()`` would split them apart."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if self._atomic_io is not None:
            self._atomic_io[1].teardown()  # waits for a background save to finish
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register(strategy_registry, cls)  # the names are defined once, in registration.py

    def _module(self) -> pl.LightningModule:
        assert self.lightning_module is not None
        return self.lightning_module


def _weights_only_given_to_the_trainer() -> bool | None:
    """The ``weights_only`` the user passed to ``trainer.fit/validate/test/predict``, which Lightning 2.6 drops.

    For a strategy that restores after setup (ours: there is nothing to load into before the model is sharded),
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so ``load_checkpoint`` always
    sees None. ``_run`` still holds it as a local: read it from that frame (None when not found, the safe default).
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_run" and isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


def _default_policy(model: nn.Module) -> set[type[nn.Module]] | None:
    """With no ``auto_wrap_policy``, each of the model's repeated blocks becomes a unit.

    One unit for the whole model would gather all of it in forward and backward: more memory than DDP. The blocks
    (:func:`~lightning_fsdp.engine.policies.repeated_block_class`) are what a user would name; the choice is logged
    once per model class, with how to override it.
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


def _flag(argument: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{argument} must be True or False, got {value!r}.")
    return value


def _check_device_mesh(device_mesh: object, sharding_strategy: str) -> tuple[int, int] | DeviceMesh | None:
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


def _check_mixed_precision(mixed_precision: object) -> Any:
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


def _check_process_group(process_group: object) -> dist.ProcessGroup | None:
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return process_group
    raise ValueError(
        f"process_group must be one torch.distributed.ProcessGroup, got {type(process_group).__name__}; for "
        "HYBRID_SHARD pass device_mesh=(replicate, shard) instead of a (shard, replicate) pair of groups."
    )


def _check_optimizers_hold_shards(optimizers: list[Optimizer], module: nn.Module) -> None:
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
