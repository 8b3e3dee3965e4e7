"""``FSDPStrategy``: Lightning's ParallelStrategy on top of our engine, used as ``Trainer(strategy="myfsdp")``.

The Trainer calls a strategy in a fixed order; this one fills the steps in as follows.

- ``__init__``: every argument checked, with one sentence that says what to change (``adapter/``).
- ``setup_environment``: ranks from Lightning's cluster environment, the HYBRID_SHARD mesh checked, then the process
  group with the strategy's timeout, so every collective of the run fails after that long instead of hanging.
- ``configure_model`` runs on the CPU with real weights, on the meta device only when an empty init was asked for.
- ``setup``: precision, sync batchnorm, the device, ``fully_shard`` in place with the user's policy or the model's
  repeated blocks; only then the optimizers, which therefore hold the shards.
- ``training_step`` and the other steps: through Lightning's forward redirection (see ``_redirect``);
  ``block_backward_sync``: gradient accumulation, reducing every micro-batch unless told otherwise.
- Checkpoints: one full file from rank 0 or one sharded folder from every rank (``lightning_fsdp/checkpoint``).
- ``on_train_start``: SLURM's requeue signal and SIGTERM are acted on at batch ends by every rank together.
"""

from __future__ import annotations

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
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_fsdp.adapter import watched_collectives
from lightning_fsdp.adapter.sharding_setup import (
    ShardedModelSetup,
    check_optimizers_hold_shards,
    flag,
)
from lightning_fsdp.adapter.strategy_arguments import SHARED_ARGUMENTS, Policy, ShardingName
from lightning_fsdp.adapter.strategy_names import register_names
from lightning_fsdp.averaging.unsupported import refuse_unsharded_averaging
from lightning_fsdp.checkpoint.async_save import BackgroundSaver
from lightning_fsdp.checkpoint.atomic import (
    remove,
    tensor_bytes,
)
from lightning_fsdp.checkpoint.callback_tensors import (
    CALLBACK_TENSORS,
    callback_tensor_targets,
    gather_callback_tensors,
    pop_callback_tensors,
)
from lightning_fsdp.checkpoint.full import (
    load_full_checkpoint,
    mark_trainable_only,
    record_optimizer_names,
    torch_optimizer_state,
)
from lightning_fsdp.checkpoint.location import is_remote
from lightning_fsdp.checkpoint.rank_zero import refuse_full_destination, save_on_rank_zero
from lightning_fsdp.checkpoint.remote import remote_kind, remove_remote
from lightning_fsdp.checkpoint.remote_last import resolve_remote_last
from lightning_fsdp.checkpoint.sharded import is_sharded_checkpoint, load_sharded, save_sharded
from lightning_fsdp.engine import CrossHostPrecision, MixedPrecision, no_sync
from lightning_fsdp.engine.optimizers import prepare_optimizer
from lightning_fsdp.engine.runtime.registry import unit_of
from lightning_fsdp.engine.state.state_dict import full_state_dict, sharded_optimizer_state_dict, sharded_state_dict
from lightning_fsdp.trainer.checkpoint_io import atomic_checkpoint_io
from lightning_fsdp.trainer.compile_support import accept_compiled_modules
from lightning_fsdp.trainer.evaluation_signals import EvaluationSignals
from lightning_fsdp.trainer.precision import FSDPPrecision, as_fsdp_precision
from lightning_fsdp.trainer.preemption import DeferredSignals
from lightning_fsdp.trainer.summary import use_full_size_summaries
from lightning_fsdp.trainer.sync_batchnorm import for_device
from lightning_fsdp.trainer.uneven_data import UnevenData

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.utilities.types import STEP_OUTPUT


class FSDPStrategy(ShardedModelSetup, ParallelStrategy):
    """Fully Sharded Data Parallel training with our engine, on CPU (gloo) and CUDA (NCCL).

    The arguments keep the names of Lightning's own ``FSDPStrategy`` where they mean the same, so moving over is one
    import or one ``class_path``.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for every Lightning
            strategy; the Trainer fills them in. ``precision_plugin`` is normally derived from
            ``Trainer(precision=...)`` (see :mod:`lightning_fsdp.trainer.precision`).
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
        forward_prefetch: gather the next unit in forward order ahead of time; None (the default): where the gathers
            cross hosts, where they would otherwise wait on the link.
        limit_all_gathers: at most two units gathered ahead of their use.
        reshard_after_forward: as torch FSDP2's: True frees the full parameters after forward, False keeps them until
            backward, an int is the ranks to stay sharded over in between -- the ranks per host, so that backward
            gathers inside each host and nothing crosses the link (docs/multi-node.md). None: what
            ``sharding_strategy`` does.
        cross_host_precision: fewer bits for what crosses between hosts (CPU ranks): ``"bf16"``, ``"int8"`` or a
            ``CrossHostPrecision(gather=..., reduce=...)``; the computation and the master weights keep their dtypes.
        gather_embedding_by_rows: between hosts, a training forward gathers the weight of an ``nn.Embedding`` no
            other module shares by the rows its lookups read (its other rows hold NaN until the unit reshards); False
            for a model that reads that weight outside the embedding's own forward.
        sync_module_states: broadcast rank 0's parameters and buffers at setup.
        param_init_fn: initializes a module materialized from the meta device (``empty_init=True``), instead of
            replaying the recorded build (or, where that cannot be replayed, its ``reset_parameters()``). As in
            torch's FSDP it is not called for modules built on a real device; when nothing is on the meta device a
            warning says so.
        process_group: the ranks to shard over (torch's keyword); the whole world by default.
        ignored_modules, ignored_states: modules (and, in ``ignored_states``, parameters) left whole on every rank,
            their gradients not reduced, as with torch's FSDP.
        use_orig_params: accepted for Lightning configs; our parameters always keep their names and identity.
        device_id: accepted when it names this rank's own device (where the strategy shards anyway).
        empty_init: build ``configure_model``'s modules on the meta device, materialized unit by unit in setup
            (lowest peak memory; the init ``__init__`` ran is recorded and replayed, so a seeded build gets the
            eager values; ``param_init_fn`` or ``reset_parameters()`` where it cannot be). By default
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
        storage_options: for checkpoints at fsspec URLs (``s3://bucket/ckpts``): the keywords of the store's fsspec
            file system (``{"endpoint_url": ..., "key": ..., "secret": ...}`` for s3fs), for every save, load and
            removal; ``trainer.save_checkpoint(..., storage_options=)`` adds to them for one save. See
            ``checkpoint/remote.py``.
        async_save: write checkpoints in the background while training goes on. Sharded: this rank's shards and
            optimizer state are copied to CPU memory at the save (what blocks training; one copy at most) and written
            by a thread, one save in flight at most, the next waiting for it; a failure is raised at the next save or
            at teardown, which waits for the last write (``checkpoint/async_save.py``); local paths only. Full: rank 0
            writes a copy of the gathered checkpoint through the ``checkpoint_io`` plugin the same way (one in flight,
            the failure raised on every rank). ``Trainer(plugins=[AsyncCheckpointIO()])`` does the same for both
            forms (the plugin it wraps writes the full file).
        **kwargs: refused, with a sentence saying what to use instead: the torch-FSDP keywords Lightning forwards
            are all among the arguments above. As in Lightning, ``strategy.kwargs`` holds those given (read-only).
            ``FabricFSDPStrategy`` takes the same arguments (``adapter/strategy_arguments.py``) but the three only the
            Trainer has (``empty_init``, ``sync_grads_each_micro_batch``, ``save_trainable_only``).
    """

    strategy_name = "myfsdp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        empty_init: bool = False,
        sync_grads_each_micro_batch: bool = True,
        save_trainable_only: bool = False,
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
        **kwargs: Any,
    ) -> None:
        shared = {name: value for name, value in locals().items() if name in SHARED_ARGUMENTS}
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._set_sharding_arguments(shared, kwargs)
        self.empty_init = flag("empty_init", empty_init)
        self.sync_grads_each_micro_batch = flag("sync_grads_each_micro_batch", sync_grads_each_micro_batch)
        self.save_trainable_only = flag("save_trainable_only", save_trainable_only)
        self._background: BackgroundSaver | None = None  # made at the first background save
        self._saves_complete_on_return = False
        self._ending_with_exception = False
        self._atomic_io: tuple[CheckpointIO, CheckpointIO] | None = None  # (the plugin, it made atomic)
        self._deferred_signals: DeferredSignals | None = None
        self._evaluation_signals: EvaluationSignals | None = None

    # ----- where and how many ---------------------------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        """True: Lightning asks strategies it does not know for this, and then gives each rank its own slice of the
        data (a ``DistributedSampler``) and lets ``self.log(..., sync_dist=True)`` reduce across ranks."""
        return True

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

    @override
    def _precision_engine_policy(self) -> MixedPrecision | None:
        return self.precision_plugin.engine_mixed_precision

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
        self._init_process_group()

    def set_world_ranks(self) -> None:
        """The Trainer's name for it: Lightning's accelerator connector calls it when it sets the strategy up."""
        self._set_world_ranks()

    # ----- sharding the model ---------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        refuse_unsharded_averaging(trainer.callbacks, self.world_size)
        self.accelerator.setup(trainer)
        self._check_device_id()
        if unit_of(self._module()) is None:
            self.model = self.precision_plugin.convert_module(self._module())
            if self._layer_sync is not None:
                self.model = for_device(self._layer_sync, self.root_device).apply(self.model)
            self.model_to_device()
            self.model = self._setup_model(self.model)
        self.barrier()
        if not any(isinstance(callback, UnevenData) for callback in trainer.callbacks):
            trainer.callbacks.insert(0, UnevenData())  # first: see [Note: uneven evaluation] in uneven_data.py
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin.device = self.root_device.type
        use_full_size_summaries(trainer)

    @override
    def model_to_device(self) -> None:
        """Move the model to its device before sharding: the engine shards a module where it lies. Tensors on the
        meta device (deferred init) stay there for the engine to materialize unit by unit on the current device;
        the real ones next to them (metric states built in ``__init__``, say) move now."""
        device = self.root_device
        self._module()._apply(lambda t: t if t.is_meta else t.to(device))

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        check_optimizers_hold_shards(self.optimizers, self._module())
        for optimizer in self.optimizers:  # before training and before a checkpoint's state: see prepare.py
            prepare_optimizer(optimizer)

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

    # ----- the steps ------------------------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        """Signals Lightning handles with collective work (SLURM's requeue save, SIGTERM's broadcast) wait for the
        next batch end, where every rank acts on them together (see [Note: deferred signals] in ``preemption.py``)."""
        self._deferred_signals = DeferredSignals.install(self._module().trainer)

    @override
    def on_validation_start(self) -> None:
        if self._module().trainer.state.fn != TrainerFn.FITTING:  # inside fit, on_train_start's handling holds
            self._evaluation_signals = EvaluationSignals.install(self._module().trainer)

    @override
    def on_test_start(self) -> None:
        self._evaluation_signals = EvaluationSignals.install(self._module().trainer)

    @override
    def on_predict_start(self) -> None:
        self._evaluation_signals = EvaluationSignals.install(self._module().trainer)

    @override
    def on_validation_end(self) -> None:
        self._remove_evaluation_signals()

    @override
    def on_test_end(self) -> None:
        self._remove_evaluation_signals()

    @override
    def on_predict_end(self) -> None:
        self._remove_evaluation_signals()

    def _remove_evaluation_signals(self) -> None:
        """SIGTERM back to Lightning's handler (see ``evaluation_signals.py``); safe to call twice."""
        if self._evaluation_signals is not None:
            self._evaluation_signals.remove()
            self._evaluation_signals = None

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
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        """Reduce ``tensor`` over the ranks (``"mean"`` or ``"sum"`` or a ``ReduceOp``); non-tensors pass through."""
        if isinstance(tensor, Tensor):
            return watched_collectives.reduce(tensor, group, reduce_op) if watched_collectives.available() else tensor
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
        """The full form: ``optimizer.state_dict()``'s own layout and keys at full shapes, on rank 0 (``{}`` elsewhere),
        what ddp's ``optimizer_state`` gives. The sharded form: keyed by parameter name, per-row tensors as DTensors,
        as Lightning's FSDP gives it. A collective."""
        if self.state_dict_type == "sharded":
            return sharded_optimizer_state_dict(self._module(), optimizer)
        return torch_optimizer_state(self._module(), optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write atomically: one file from rank 0, or one folder (DCP shards from every rank plus ``meta.pt``).

        Callbacks' per-rank tensors (``ShardedEMA``'s averaged rows) go with the form: gathered into the full file,
        rank by rank into the folder (``checkpoint/callback_tensors.py``). Either way the destination is checked
        first, on rank 0 and for every rank: a save replaces only a checkpoint of the same form and refuses anything
        else (a user's folder, a foreign file) before a byte is written. The full file goes through the
        ``checkpoint_io`` plugin made atomic (see ``checkpoint_io.py``). With ``async_save`` or ``AsyncCheckpointIO``
        either form is written in the background (``checkpoint/async_save.py``) and appears when complete.
        ``filepath`` may be an fsspec URL (``s3://...``): see ``checkpoint/remote.py``.
        """
        if self.save_trainable_only:
            mark_trainable_only(checkpoint)
        if self.state_dict_type == "sharded":
            state = {"model": checkpoint.pop("state_dict")}
            for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
                state[f"optimizer_{index}"] = optimizer_state
            if callback_tensors := pop_callback_tensors(checkpoint):
                state[CALLBACK_TENSORS] = callback_tensors
            if self._saves_in_background():
                self._save_sharded_in_background(filepath, state, checkpoint)
                return
            save_sharded(filepath, state, checkpoint, self._storage_options(storage_options))
            return
        gather_callback_tensors(checkpoint)
        if self.is_global_zero and "optimizer_states" in checkpoint:  # what `convert` keys the positional state by
            record_optimizer_names(checkpoint, self._module(), self.optimizers)
        if self._saves_in_background():
            self._background_saver().wait()  # the previous write's failure comes first
        options = self._storage_options(storage_options) if is_remote(filepath) else storage_options
        refuse_full_destination(filepath, tensor_bytes(checkpoint) if self.is_global_zero else 0, options)
        if self._saves_in_background():
            self._save_full_in_background(checkpoint, filepath, options)
            return
        io = self._atomic_checkpoint_io()
        save_on_rank_zero(
            filepath, lambda: io.save_checkpoint(checkpoint, filepath, options) if self.is_global_zero else None
        )

    def _saves_in_background(self) -> bool:
        return self.async_save or isinstance(self.checkpoint_io, AsyncCheckpointIO)

    def _background_saver(self) -> BackgroundSaver:
        if self._background is None:
            self._background = BackgroundSaver(self._timeout)
        return self._background

    def _save_sharded_in_background(self, filepath: _PATH, state: dict[str, Any], meta: dict[str, Any]) -> None:
        if is_remote(filepath):
            raise ValueError(
                f"asynchronous sharded saves write to local paths only, not {filepath}; save to a local folder, or "
                "drop async_save (and AsyncCheckpointIO) to save to a store."
            )
        self._background_saver().save(filepath, state, meta)
        if self._saves_complete_on_return:
            self._background_saver().wait()

    def _save_full_in_background(self, checkpoint: dict[str, Any], filepath: _PATH, options: Any | None) -> None:
        """Rank 0 writes a snapshot of ``checkpoint`` (its tensors cloned, as Lightning's ``AsyncCheckpointIO`` does:
        the next steps must not change what is written) through the plugin made atomic, in the background."""
        io = self._atomic_checkpoint_io()
        rank0 = self.is_global_zero
        snapshot = apply_to_collection(checkpoint, Tensor, lambda tensor: tensor.detach().clone()) if rank0 else None

        def write() -> None:
            if snapshot is not None:
                io.save_checkpoint(snapshot, filepath, options)

        self._background_saver().write(filepath, write)
        if self._saves_complete_on_return:
            self._background_saver().wait()

    @contextmanager
    def saves_complete_on_return(self) -> Generator[None, None, None]:
        """Inside this, a background save is waited for before ``save_checkpoint`` returns: a save after which the
        process may end at once (SLURM's requeue, see ``preemption.py``)."""
        self._saves_complete_on_return = True
        try:
            yield
        finally:
            self._saves_complete_on_return = False

    def _storage_options(self, given: Any | None) -> dict[str, Any] | None:
        """The strategy's ``storage_options`` with those given to one call on top."""
        return {**(self.storage_options or {}), **(given or {})} or None

    def _atomic_checkpoint_io(self) -> CheckpointIO:
        """``self.checkpoint_io`` made atomic and synchronous (``AsyncCheckpointIO``: the plugin it wraps), built once
        per plugin."""
        io = self.checkpoint_io
        if self._atomic_io is None or self._atomic_io[0] is not io:
            self._atomic_io = (io, atomic_checkpoint_io(io))
        return self._atomic_io[1]

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Delete our checkpoint at ``filepath`` (``ModelCheckpoint``'s rotation); at a URL, only our own objects.

        Locally, rank 0 removes a full file and every rank that sees a sharded folder there removes it: ranks that
        share no disk each published their own (see [Note: ranks that share no disk] in ``checkpoint/atomic.py``).
        While a background save is in flight the removal waits for it and happens only if it succeeds: the checkpoint
        being removed is the one the new save replaces."""
        if self._background is not None:
            self._background.remove_later(lambda: self._remove_now(filepath))
            return
        self._remove_now(filepath)

    def _remove_now(self, filepath: _PATH) -> None:
        if self.is_global_zero and is_remote(filepath):
            left = remove_remote(filepath, self.storage_options)
            if left is not None:
                rank_zero_warn(f"not removing {filepath}: {left}")
        elif is_remote(filepath):
            return
        elif self.is_global_zero or (self.state_dict_type == "sharded" and is_sharded_checkpoint(filepath)):
            remove(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model (and, when fitting, optimizer) states into the shards; return the rest of the checkpoint.

        A folder is a sharded checkpoint (any world size); a file is a full one -- ours, ddp's or a single
        device's. Everything is checked before anything is loaded, and nothing but plain data is unpickled unless
        the user trusts the file: ``trainer.fit(..., weights_only=False)`` or ``FSDPStrategy(trust_checkpoint=True)``
        (an explicit ``weights_only=True`` wins over the latter). At an fsspec URL, an object is a full checkpoint
        and a prefix a sharded one.
        """
        if self._background is not None:
            self._background.wait()  # a checkpoint still being written is loaded once complete
        module = self._module()
        optimizers = self.optimizers if module.trainer.state.fn == TrainerFn.FITTING else []
        weights_only = weights_only if weights_only is not None else _weights_only_given_to_the_trainer()
        trust = weights_only is False or (weights_only is None and self.trust_checkpoint)
        opt_in = "trainer.fit(..., weights_only=False) or FSDPStrategy(trust_checkpoint=True)"
        targets = callback_tensor_targets(module.trainer.callbacks)  # ShardedEMA's rows, say
        if is_remote(checkpoint_path):  # at a URL: what rank 0 finds there (a prefix: sharded; an object: full)
            kind = self.broadcast(remote_kind(checkpoint_path, self.storage_options) if self.is_global_zero else None)
            if kind is None:
                raise FileNotFoundError(f"no checkpoint at {checkpoint_path}; pass a .ckpt object or a sharded prefix.")
            load = load_sharded if kind == "sharded" else load_full_checkpoint
            strict = module.strict_loading
            return load(checkpoint_path, module, optimizers, strict, trust, opt_in, targets, self.storage_options)
        path = Path(checkpoint_path)
        if not path.exists():
            raise FileNotFoundError(f"no checkpoint at {path}; pass a .ckpt file or a sharded checkpoint folder.")
        load = load_sharded if path.is_dir() else load_full_checkpoint
        return load(path, module, optimizers, module.strict_loading, trust, opt_in, targets)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Deliberately nothing: ``load_checkpoint`` already loaded the model, straight into the shards."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Deliberately nothing: ``load_checkpoint`` already loaded the optimizers."""

    # ----- the end --------------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The run ends with ``exception``: teardown then reports a failed background save as a warning instead of
        raising it over the exception already on its way."""
        self._ending_with_exception = True

    @override
    def teardown(self) -> None:
        """Give back what the run took, however it ended (see [Note: what a run gives back] in
        ``engine/state/release.py``): the engine's shared memory and buffers, the thread watching the main thread, the
        signal handlers, the plugins. The model stays where it is (unlike the base class, which moves it to the CPU),
        its shards in memory of their own: it can be saved, read, or fitted again by a new Trainer.

        A background save still in flight is waited for first; its failure is raised once everything is released."""
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        failure = self._background.close() if self._background is not None else None
        if self._deferred_signals is not None:
            self._deferred_signals.remove()
        self._remove_evaluation_signals()
        self._end_run([self.lightning_module] if self.lightning_module is not None else [])
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        if self._atomic_io is not None:
            self._atomic_io[1].teardown()
        self.checkpoint_io.teardown()
        ending_with_exception, self._ending_with_exception = self._ending_with_exception, False
        if failure is not None and ending_with_exception:
            rank_zero_warn(f"{failure}", category=RuntimeWarning)
        elif failure is not None:
            raise failure

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls)

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


accept_compiled_modules(FSDPStrategy)
resolve_remote_last(FSDPStrategy)
FSDPStrategy.register_strategies(StrategyRegistry)  # the registry's entries for our names: this class
