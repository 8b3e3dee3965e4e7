"""One sharding unit: the parameters of one module, gathered, freed and reduced together.

A unit issues exactly one collective per transition (one all-gather to unshard, one reduce-scatter or all-reduce
to reduce gradients) over a flat buffer packed from all its parameters, as the FSDP paper's FlatParameter does,
while each parameter keeps its own name, shape and dim-0 shard (see ``param.py``).

[Note: profiler labels] Every transition that does work runs under a ``torch.profiler.record_function`` label, so a
profile (and a CUDA trace) shows the engine's phases by name: ``lightning_fsdp.unshard`` (pack and issue the
all-gather), ``lightning_fsdp.wait_unshard`` (wait, copy out, register the full parameters),
``lightning_fsdp.reshard``, ``lightning_fsdp.reduce_grads`` (pack and issue the reduction),
``lightning_fsdp.wait_reduce`` (wait, accumulate into the sharded ``.grad``) and ``lightning_fsdp.summon`` (the
master weights' gather of ``summon_full_params``, between steps). Tools rely on these exact names. The training
ones are only reached from the runtime hooks, which torch.compile leaves out of its graphs (see [Note: hooks stay out of
compiled graphs] in ``hooks.py``). They also count their bytes and the seconds they hold the training thread, in
``step_stats.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.profiler import record_function
from torch.utils.hooks import RemovableHandle

from lightning_fsdp.engine.diagnostics.step_stats import STEP_STATS
from lightning_fsdp.engine.features.embedding_rows import LookedUpRows, looks_up_rows_only
from lightning_fsdp.engine.features.sparse_rows import RowRegion, sum_over_replicas_by_rows
from lightning_fsdp.engine.options import ShardingOptions
from lightning_fsdp.engine.runtime.comm_context import CommContext
from lightning_fsdp.engine.runtime.grad_reduction import (
    PendingGradReduction,
    divide_before_reducing,
    row_regions,
)
from lightning_fsdp.engine.runtime.masters import gather_grads, gather_masters
from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.runtime.whole_tensors import WholeTensors
from lightning_fsdp.engine.transport import Pending, Transport, standalone_transport
from lightning_fsdp.engine.transport.identity import Stamp
from lightning_fsdp.engine.transport.packing import RankRows

# Gradients of at least this many bytes that arrive while other units' backward is still to run are reduced at
# once, in a collective of their own: see [Note: gradients that arrive long before their unit's backward ends] in
# root.py.
EARLY_REDUCTION_MIN_BYTES = 1 << 20


class ShardState(Enum):
    SHARDED = auto()  # only the local shards exist; the module holds them
    HOST_SHARDED = auto()  # the module holds the shards; this rank also keeps its host's share (``host_rows``)
    UNSHARDING = auto()  # the all-gather is in flight; the module still holds the shards
    UNSHARDED = auto()  # full tensors allocated and registered on the module


class AfterForward(Enum):
    """What a unit's full parameters become after its forward (``reshard_after_forward``, resolved per transport)."""

    RESHARD = auto()  # freed; backward gathers them again from every rank
    TO_HOST = auto()  # freed, this rank's host rows kept; backward gathers inside the host (see hierarchical.py)
    KEEP = auto()  # kept until backward ends


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # backward has reached the unit's outputs; its gradients are being computed
    POST_BACKWARD = auto()  # its gradients are reduced (or kept, when gradient sync is off) for this step


IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = TrainingState
ANY_STATE = frozenset(TrainingState)

# The step's lifecycle in one place: every change of a unit's ``training_state`` is one of these moves, made by the
# method the comment names, from one of the states listed to one of the states listed (an empty target: a check that
# changes nothing). Any other order raises at once -- the hooks ran out of order -- instead of computing with freed
# or stale memory. The stages are those of ``hooks.py``.
TRANSITIONS: dict[str, tuple[frozenset[TrainingState], frozenset[TrainingState]]] = {
    "begin its forward": (ANY_STATE, frozenset({FORWARD})),  # begin_forward, stage 2 (forward inside a backward too)
    "end its forward": (frozenset({FORWARD}), frozenset({FORWARD, IDLE})),  # end_forward, stage 3 (nested calls)
    "begin its backward": (frozenset({IDLE, FORWARD}), frozenset({PRE_BACKWARD})),  # begin_backward, stage 4
    "finish its backward": (frozenset({IDLE, FORWARD, PRE_BACKWARD}), frozenset({POST_BACKWARD})),  # stage 5
    "end its step": (ANY_STATE, frozenset({FORWARD, IDLE})),  # end_step, stage 6 (FORWARD: backward inside forward)
    "leave its run": (ANY_STATE, frozenset({IDLE})),  # leave_run: the run ended, maybe mid-step
    "hold tensors whole": (frozenset({IDLE}), frozenset()),  # hold_whole: between steps only
    "show its full parameters": (frozenset({IDLE}), frozenset()),  # summon: between steps only
}


class FSDPUnit:
    """The parameters one ``fully_shard`` unit owns, and the moves between their sharded and unsharded forms.

    Rows are spread over ``shard_group`` (None: one rank holds all rows) and gradients are then summed over
    ``replicate_group`` (HYBRID_SHARD's replicas, NO_SHARD's ranks). With NO_SHARD in the parameters' own dtype
    the parameters stay where they are (``replicated``) and only the gradient all-reduce remains.
    """

    def __init__(
        self,
        module: nn.Module,
        params: list[FSDPParam],
        replicated: list[nn.Parameter],
        groups: tuple[ProcessGroup | None, ProcessGroup | None],
        options: ShardingOptions,
    ) -> None:
        self.module = module
        self.name = type(module).__name__  # its path under the root, once the root's lazy init has named it
        self.params = params
        self.replicated = replicated
        self.shard_group, self.replicate_group = groups
        self.world_size = self.shard_group.size() if self.shard_group is not None else 1
        replicas = self.replicate_group.size() if self.replicate_group is not None else 1
        self.total_world_size = self.world_size * replicas
        self.options = options
        # See [Note: one rank keeps the parameter whole] in param.py: nothing to gather, copy or reduce.
        self.is_whole = bool(params) and all(p.is_whole for p in params)
        self.shard_state = ShardState.SHARDED if params else ShardState.UNSHARDED
        self.after_forward = AfterForward.RESHARD if options.reshard_after_forward else AfterForward.KEEP
        self.host_rows: list[torch.Tensor] | None = None  # see [Note: resharded to the host] in hierarchical.py
        self.training_state = TrainingState.IDLE
        self.is_root = False
        # Forwards of this unit entered and not yet returned (backward may run in between). More than one when the
        # forward is re-entered: the strategy runs a LightningModule's training_step as its root's forward, and the
        # step then calls the module's own forward.
        self.forward_depth = 0
        self.requires_grad_sync = True
        self._pending_gather: Pending[None] | None = None
        self.prefetched = False  # unsharded ahead of use; cleared when the unit is used
        self.summoned = False  # inside summon_full_params: its modules hold the full master values
        self.context: CommContext | None = None  # the context of the root this unit runs under, set at its lazy init
        self.grads_expected = 0  # trainable parameters, counted at pre-forward
        self.grads_seen = 0  # gradients accumulated so far in this backward
        self.hooked_params: set[int] = set()  # ids of the grad tensors carrying our post-accumulate hook
        self._param_of_grad_tensor = {id(p.unsharded): p for p in params}
        # See [Note: gradients that arrive long before their unit's backward ends].
        self.arrived: list[FSDPParam] = []  # gradients in since the last reduction of this backward, in order
        self.reduced_early: set[int] = set()  # ids of the FSDPParams whose gradients this backward reduced already
        # See [Note: post-backward of partly frozen units] in hooks.py.
        self.input_grads_pending = 0  # forwards of this step whose input gradients backward has yet to compute
        self.awaits_final_callback = False  # frozen parameters, no input needing a gradient: stage 6 finishes it
        self._call_guards: list[RemovableHandle] = []  # see [Note: a submodule called while its unit is sharded]
        self.looked_up: list[LookedUpRows] = []  # see [Note: an embedding's rows as they are looked up]
        self.wholes: list[WholeTensors] = []  # see [Note: whole tensors] in whole_tensors.py

    # ----- the state machine: every change of the fields above goes through these methods ------------------------

    def _move(self, transition: str, to: TrainingState | None = None) -> None:
        """Make ``transition`` (a row of ``TRANSITIONS``), to ``to`` if it changes the state."""
        sources, targets = TRANSITIONS[transition]
        if self.training_state not in sources:
            raise RuntimeError(
                f"{self!r} (unit '{self.name}') cannot {transition} while {self.training_state.name}: the engine's "
                "hooks ran out of order. Please report this with the model that triggers it."
            )
        if to is not None:
            assert to in targets, f"{transition} cannot lead to {to.name}"
            self.training_state = to

    def claim(self, context: CommContext, name: str, is_root: bool) -> None:
        """The root whose lazy init found this unit runs it from now on; ``name`` is its path under that root."""
        self.context, self.name, self.is_root = context, name, is_root

    def leave_root(self) -> None:
        """A later ``fully_shard`` call above this unit made a new root, which claims it at its first forward."""
        self.context, self.is_root = None, False
        for handle in self._call_guards:  # the new root guards its own children; this unit's forward stays lean
            handle.remove()
        self._call_guards = []

    def guard_calls(self, handles: list[RemovableHandle]) -> None:
        """Keep the hooks that refuse calls into this unit's submodules while it is sharded, to remove them later."""
        self._call_guards = handles

    @property
    def shows_full_params(self) -> bool:
        """Whether its modules hold the full parameters now: gathered, or inside ``summon_full_params``."""
        return self.shard_state is ShardState.UNSHARDED or self.summoned

    def set_requires_grad_sync(self, requires_grad_sync: bool) -> None:
        self.requires_grad_sync = requires_grad_sync

    def begin_forward(self, records_grads: bool) -> None:
        """Stage 2 starts (not a recomputation: the caller checked ``is_recomputing``)."""
        self._move("begin its forward", FORWARD)
        self.forward_depth += 1
        if records_grads:
            self.grads_expected = self.num_trainable()

    def end_forward(self) -> None:
        """Stage 3: the unit's forward returned."""
        self.forward_depth -= 1
        self._move("end its forward", FORWARD if self.in_forward else IDLE)

    @property
    def in_forward(self) -> bool:
        """Between this unit's pre- and post-forward."""
        return self.forward_depth > 0

    @property
    def is_recomputing(self) -> bool:
        """A forward while backward is inside this unit: activation checkpointing recomputes it."""
        return self.training_state is TrainingState.PRE_BACKWARD

    def resolve_after_forward(self, transport: Transport) -> None:
        """``reshard_after_forward`` for this unit's group, once the root has chosen its transport: a number of
        ranks means the whole group (True), one rank (False), or the ranks per host of a group that spans hosts."""
        setting = self.options.reshard_after_forward
        if isinstance(setting, bool):
            self.after_forward = AfterForward.RESHARD if setting else AfterForward.KEEP
        elif setting == self.world_size:
            self.after_forward = AfterForward.RESHARD
        elif setting == 1:
            self.after_forward = AfterForward.KEEP
        elif setting == transport.ranks_per_host:
            self.after_forward = AfterForward.TO_HOST
        else:
            hosts = (
                f"{transport.ranks_per_host} ranks on each of its hosts"
                if transport.ranks_per_host is not None
                else "no hosts that each hold the same number of its ranks in a row"
            )
            raise ValueError(
                f"reshard_after_forward={setting} is not a size this unit's group of {self.world_size} ranks can stay "
                f"sharded over: it has {hosts}; pass the ranks per host, True (all {self.world_size}) or False."
            )

    def choose_looked_up_rows(self, transport: Transport) -> None:
        """Which embedding weights this unit's training gathers leave to their lookups, once the root has chosen its
        transport (see [Note: an embedding's rows as they are looked up])."""
        for rows in self.looked_up:
            rows.remove()
        self.looked_up = []
        if transport.gathers_rows and self.options.gather_embedding_by_rows and not self.is_whole:
            self.looked_up = [
                LookedUpRows(p, self.gather_rows, lambda: self.shows_full_params)
                for p in self.row_params
                if looks_up_rows_only(p)
            ]

    def shard_home_bytes(self) -> tuple[int, ...]:
        """The bytes of each of this unit's padded shards where a transport may keep them (see [Note: shards that
        live in shared memory] in ``transport/shm/homes.py``): on the CPU and gathered in their own dtype; ()
        otherwise."""
        if self.is_whole or not self.params or self.world_size < 2:
            return ()
        dtype = self.params[0].sharded.dtype
        on_cpu = all(p.sharded.device.type == "cpu" and p.compute_device.type == "cpu" for p in self.params)
        same_dtype = all(p.sharded.dtype == dtype for p in self.params)
        sizes = tuple(numel * dtype.itemsize for numel in self._shard_numels())
        if not (on_cpu and same_dtype and all(sizes)) or (self.options.mixed_precision.param_dtype or dtype) != dtype:
            return ()
        return sizes

    def _shard_numels(self) -> list[int]:
        """The elements of each shard this unit's all-gather sends: its rows' parameters', then its segments of
        whole tensors."""
        return [p.layout.shard_numel for p in self.row_params] + [whole.columns for whole in self.wholes]

    def keep_shards_at_home(self, transport: Transport) -> None:
        """Move the shards into the home ``transport`` has for them, if it has one."""
        if not self.shard_home_bytes():
            return
        homes = transport.home_for_shards(self._shard_numels(), self.params[0].sharded.dtype)
        if homes is None:
            return
        for fsdp_param, home in zip(self.row_params, homes, strict=False):
            fsdp_param.move_shard_to(home)
        for whole, home in zip(self.wholes, homes[len(self.row_params) :], strict=True):
            whole.move_to(home)

    @property
    def row_params(self) -> list[FSDPParam]:
        """The parameters whose rows are spread over the ranks (all but those held whole)."""
        return [p for p in self.params if p.layout.owner is None]

    def hold_whole(self, params: list[FSDPParam], owners: list[int]) -> None:
        """From now on ``params`` (some of this unit's, spread by rows) live whole on ``owners``, with their values
        and gradients (see [Note: whole tensors] in whole_tensors.py). A collective over the shard group, between
        steps; the transport keeps the new layout once the root has chosen it again (``RootContext.relaid``)."""
        self._move("hold tensors whole")
        if self.summoned or self.shard_state is not ShardState.SHARDED:
            raise RuntimeError(f"unit '{self.name}' can change its layout only between steps, outside summon.")
        with torch.no_grad():
            full = [value for _, value in gather_masters(params)]
            grads = gather_grads(params)
            gather_dtype = self.options.mixed_precision.param_dtype or params[0].sharded.dtype
            whole = WholeTensors(params, owners, full, gather_dtype)
            for fsdp_param, grad in zip(params, grads, strict=True):
                fsdp_param.sharded.grad = None
                if grad is not None and fsdp_param.sharded.numel():
                    fsdp_param.sharded.grad = torch.empty_like(fsdp_param.sharded).copy_(grad)
        self.wholes.append(whole)

    @property
    def needs_gather(self) -> bool:
        """Whether the full parameters are neither gathered nor on their way."""
        return self.shard_state in (ShardState.SHARDED, ShardState.HOST_SHARDED)

    def prefetch(self) -> None:
        """Start the gather ahead of use; the rate limiter counts the unit until ``use`` or ``reshard``."""
        if self.needs_gather:
            self.unshard()
            self.prefetched = True

    def use(self) -> None:
        """Wait for the full parameters this unit's forward or backward is about to read."""
        self.wait_for_unshard()
        self.prefetched = False

    def hook_trainable_params(self, on_grad: Callable[[nn.Parameter], None]) -> None:
        """Hook each parameter the first time it is trainable (frozen ones cannot be hooked; they may thaw later)."""
        if len(self.hooked_params) == self.grads_expected:
            return
        for param in self.grad_params():
            if param.requires_grad and id(param) not in self.hooked_params:
                param.register_post_accumulate_grad_hook(on_grad)
                self.hooked_params.add(id(param))

    def expect_input_grads(self, any_input_needs_grad: bool) -> None:
        """See [Note: post-backward of partly frozen units] in ``hooks.py``: wait for the gradients of this forward's
        inputs too, or, when none needs one, for the final callback."""
        if any_input_needs_grad:
            self.input_grads_pending += 1
        else:
            self.awaits_final_callback = True

    def input_grads_arrived(self) -> None:
        self.input_grads_pending = max(self.input_grads_pending - 1, 0)

    def grad_accumulated(self, grad_tensor: torch.Tensor) -> None:
        self.grads_seen += 1
        fsdp_param = self._param_of_grad_tensor.get(id(grad_tensor))
        if fsdp_param is None:
            return
        if id(fsdp_param) in self.reduced_early:
            raise RuntimeError(
                f"The gradient of '{fsdp_param.fqn}' (unit '{self.name}') arrived a second time in one backward, "
                "after the first one was reduced and its full parameter freed; this happens when a parameter is "
                "used both inside and outside a reentrant activation-checkpointed region: use "
                "`checkpoint(..., use_reentrant=False)` (the engine's apply_activation_checkpointing does)."
            )
        if fsdp_param.layout.owner is None:  # a whole tensor's memory is its segment's: freed with the unit's
            self.arrived.append(fsdp_param)

    def reduce_arrived_early(self) -> PendingGradReduction | None:
        """Reduce the gradients that arrived so far and free their full parameters, while the backward of other
        units (nested inside this one) runs; see [Note: gradients that arrive long before their unit's backward ends].
        None, and the gradients wait for the unit's own reduction, when they are too few to be worth a collective."""
        if self.is_whole or not self.requires_grad_sync or self.in_forward or not self.arrived:
            return None
        if self.training_state is not TrainingState.PRE_BACKWARD:
            return None
        grads = [p.unsharded.grad for p in self.arrived]
        if sum(g.numel() * g.element_size() for g in grads if g is not None) < EARLY_REDUCTION_MIN_BYTES:
            return None
        arrived, self.arrived = self.arrived, []
        with record_function("lightning_fsdp.reduce_grads"):
            reduction = self._reduce_scatter_grads(arrived)
            for fsdp_param in arrived:
                self.reduced_early.add(id(fsdp_param))
                fsdp_param.register_sharded()
                fsdp_param.free_unsharded()
        return reduction

    def begin_backward(self) -> bool:
        """Stage 4: backward reached the unit's outputs. False when it had already (several outputs, one backward)."""
        if self.training_state in (PRE_BACKWARD, POST_BACKWARD):
            return False
        self._move("begin its backward", PRE_BACKWARD)
        return True

    @property
    def backward_complete(self) -> bool:
        """Every gradient this unit's backward computes is in (see the notes on post-backward in ``hooks.py``)."""
        complete = self.grads_seen >= self.grads_expected and self.input_grads_pending == 0
        return complete and not self.awaits_final_callback and self.training_state is not TrainingState.POST_BACKWARD

    @property
    def backward_unfinished(self) -> bool:
        """Backward reached the unit but stage 5 has not run (the final callback finishes it)."""
        reached = self.training_state is TrainingState.PRE_BACKWARD or self.grads_seen > 0
        return reached and self.training_state is not TrainingState.POST_BACKWARD

    def finish_backward(self) -> PendingGradReduction | None:
        """Stage 5: reshard, launch the gradient reduction (unless sync is off), and say so.

        Resharding first gives the full parameters back before the reduction packs (and, for a unit larger than a
        shared-memory slot, mostly runs: see [Note: chunks] in ``transport/shm/slots.py``): the gradients are tensors
        of their own, so a rank never holds a unit's full parameters, its full gradients and its reduced rows at once.
        For a language model's root (embedding and head) that is the peak of the step.
        """
        self._move("finish its backward")
        if not self.in_forward:  # see [Note: backward inside a forward] in hooks.py
            self.reshard()
        reduction = self.reduce_grads() if self.requires_grad_sync else None
        self.arrived = []
        self._move("finish its backward", POST_BACKWARD)
        return reduction

    def end_step(self) -> None:
        """Stage 6, once every reduction is finished: back to the state a forward starts from."""
        self.grads_seen = 0
        self.input_grads_pending = 0
        self.awaits_final_callback = False
        self.arrived = []
        self.reduced_early = set()
        if self.in_forward:  # see [Note: backward inside a forward] in hooks.py
            self._move("end its step", FORWARD)
            return
        self.reshard()
        self._move("end its step", IDLE)

    def leave_run(self, transport: Transport | None) -> None:
        """The run that claimed this unit ended (see [Note: what a run gives back] in ``release.py``), maybe in the
        middle of a step: the shards registered again, in memory of their own (out of ``transport``'s, its shard
        group's), the full parameters freed, the unit idle and unclaimed until the next forward's root claims it. A
        gather still in flight is dropped, not awaited (its peers may be gone), and the memory it writes into is left
        to it."""
        gathering = self.shard_state is ShardState.UNSHARDING
        self._pending_gather = None
        for fsdp_param in self.params:
            fsdp_param.register_sharded()
            if not gathering:
                fsdp_param.free_unsharded()
        if transport is not None:
            self.move_shards_out_of(transport)
        for rows in self.looked_up:  # chosen again with the next root's transport (``choose_looked_up_rows``)
            rows.end()
        self.host_rows, self.context = None, None
        self.shard_state = ShardState.SHARDED if self.params else ShardState.UNSHARDED
        self._move("leave its run", IDLE)
        self.forward_depth, self.prefetched = 0, False
        self.grads_seen, self.input_grads_pending, self.awaits_final_callback = 0, 0, False
        self.arrived, self.reduced_early = [], set()

    def move_shards_out_of(self, transport: Transport) -> None:
        """Shards that live in ``transport``'s memory (homes: see [Note: shards that live in shared memory]) move into
        memory of their own, before the transport closes. The same Parameters, their ``.data`` swapped: the
        optimizer's state keyed by them stays valid."""
        for fsdp_param in self.row_params:
            if transport.holds(fsdp_param.padded_shard):
                fsdp_param.move_shard_to(torch.empty_like(fsdp_param.padded_shard))
        for whole in self.wholes:
            if transport.holds(whole.padded_shard):
                whole.move_to(torch.empty_like(whole.padded_shard))

    # ----- transports -------------------------------------------------------------------------------------------

    def transport(self) -> Transport:
        """The transport of the shard group, chosen by the root (see [Note: one transport per group])."""
        if self.context is not None:
            return self.context.transport_of(self.shard_group)
        return standalone_transport(self.shard_group, self.compute_device())  # before any root: state dicts

    def replicate_transport(self) -> Transport:
        """The transport of the replicate group (HYBRID_SHARD's replicas, NO_SHARD's ranks)."""
        if self.context is not None:
            return self.context.transport_of(self.replicate_group)
        return standalone_transport(self.replicate_group, self.compute_device())

    def compute_device(self) -> torch.device:
        """Where forward and backward use this unit's parameters."""
        if self.params:
            return self.params[0].compute_device
        return self.replicated[0].device if self.replicated else torch.device("cpu")

    def stamp(self, kind: str, numel: int, dtype: torch.dtype) -> Stamp | None:
        """The identity of this unit's next collective (see [Note: collective identity]); none before a root."""
        ledger = self.context.ledger if self.context is not None else None
        return ledger.stamp(kind, numel * dtype.itemsize, self.name) if ledger is not None else None

    def gather_rows(self, wanted: torch.Tensor, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Gather into ``full`` the rows ``wanted`` marks, from the ranks whose ``shard`` holds them (a collective of
        this unit: see [Note: an embedding's rows as they are looked up] in ``embedding_rows.py``)."""
        stamp = self.stamp("all-gather", wanted.numel(), torch.uint8)
        transport = self.transport()
        received = transport.gather_rows(wanted, shard, full, stamp)
        STEP_STATS.gathered(self.name, transport.name, received * full.element_size() * full.shape[1])

    def send_bytes(self) -> dict[str, int]:
        """The send buffer of each collective this unit issues, by kind: its packed shards (``all_gather``), its
        gradients by rank (``reduce_scatter``), and the gradients summed over replicas (``all_reduce``)."""
        mixed = self.options.mixed_precision
        if not self.params:
            trainable = [p for p in self.replicated if p.requires_grad]
            dtype = mixed.effective_reduce_dtype or (trainable[0].dtype if trainable else torch.float32)
            return {"all_reduce": sum(p.numel() for p in trainable) * dtype.itemsize}
        shard_numel = sum(self._shard_numels())
        trainable_numel = sum(p.layout.shard_numel for p in self.row_params if p.requires_grad) + sum(
            whole.columns for whole in self.wholes if any(p.requires_grad for p in whole.params)
        )
        param_dtype = mixed.param_dtype or self.params[0].sharded.dtype
        reduce_dtype = mixed.effective_reduce_dtype or param_dtype
        return {
            "all_gather": shard_numel * param_dtype.itemsize,
            "reduce_scatter": self.world_size * trainable_numel * reduce_dtype.itemsize,
            "all_reduce": trainable_numel * reduce_dtype.itemsize,
        }

    def __repr__(self) -> str:
        return f"FSDPUnit({type(self.module).__name__}, params={len(self.params) + len(self.replicated)})"

    # ----- parameters: sharded <-> unsharded -------------------------------------------------------------------

    def unshard(self) -> None:
        """Start gathering the full parameters (asynchronously); a no-op when they are gathered or in flight.

        From ``HOST_SHARDED`` the gather stays inside the host; a training forward of a unit resharded to the host
        keeps its host rows on the way (see [Note: resharded to the host] in ``transport/hierarchical.py``)."""
        if not self.needs_gather:
            return
        if self.is_whole:
            self.shard_state = ShardState.UNSHARDED  # the registered parameters are the full ones already
            return
        keep_host_rows = self.after_forward is AfterForward.TO_HOST and torch.is_grad_enabled() and not self.is_root
        # A training gather leaves an embedding's weight to its lookups (and backward needs none of it).
        by_lookup = torch.is_grad_enabled() or self.context.callback_queued
        with record_function("lightning_fsdp.unshard"), torch.no_grad():
            for fsdp_param in self.params:
                fsdp_param.alloc_unsharded()
            for rows in self.looked_up:
                rows.begin(active=by_lookup)
            left_out = {id(rows.param) for rows in self.looked_up if rows.active}
            gathered = [p for p in self.row_params if id(p) not in left_out] + self.wholes
            shards = [entry.padded_shard for entry in gathered]
            dtype = self.options.mixed_precision.param_dtype or self.params[0].sharded.dtype
            numel = sum(shard.numel() for shard in shards)
            stamp = self.stamp("all-gather", numel, dtype) if self.world_size > 1 and gathered else None
            dests = [entry.unsharded_buffer for entry in gathered]
            transport = self.transport()
            started = time.perf_counter()
            if not gathered:
                self._pending_gather = Pending.done(None)
            elif self.host_rows is not None:
                self._pending_gather = transport.gather_in_host(self.host_rows, dtype, stamp, dests)
            elif keep_host_rows:
                hosts = self.world_size // (transport.ranks_per_host or 1)
                self.host_rows = [shard.new_empty(hosts * shard.numel(), dtype=dtype) for shard in shards]
                self._pending_gather = transport.all_gather_to_host(shards, dtype, stamp, dests, self.host_rows)
            else:
                self._pending_gather = transport.all_gather_into(shards, dtype, stamp, dests)
            STEP_STATS.blocked_since(started)
            STEP_STATS.gathered(self.name, transport.name, numel * dtype.itemsize)
        self.shard_state = ShardState.UNSHARDING

    def wait_for_unshard(self) -> None:
        """Finish the gather, copy every parameter out of the flat buffer and register the full tensors."""
        if self.needs_gather:
            self.unshard()
        if self.shard_state is ShardState.UNSHARDED:
            return
        assert self._pending_gather is not None
        pending, self._pending_gather = self._pending_gather, None
        with record_function("lightning_fsdp.wait_unshard"), torch.no_grad():
            started = time.perf_counter()
            pending.wait()  # the gathered rows are in the unsharded buffers
            STEP_STATS.blocked_since(started)
            for fsdp_param in self.params:
                fsdp_param.register_unsharded()
        self.shard_state = ShardState.UNSHARDED

    def end_forward_gathered(self) -> None:
        """Stage 3 for a unit whose backward is not next: what ``reshard_after_forward`` says."""
        if self.after_forward is AfterForward.RESHARD:
            self.reshard()
        elif self.after_forward is AfterForward.TO_HOST:
            self.reshard(keep_host_rows=True)

    def reshard(self, keep_host_rows: bool = False) -> None:
        """Register the shards again and give the full tensors' memory back; with ``keep_host_rows``, the host rows a
        training forward's gather kept stay for backward (``HOST_SHARDED``)."""
        if not self.params:
            return
        if self.shard_state is ShardState.UNSHARDING:
            self.wait_for_unshard()  # never free memory a collective is still writing into
        keep = keep_host_rows and self.host_rows is not None
        if not keep:
            self.host_rows = None
        if self.shard_state is ShardState.SHARDED or (self.shard_state is ShardState.HOST_SHARDED and keep):
            return
        if self.shard_state is ShardState.UNSHARDED:
            with record_function("lightning_fsdp.reshard"):
                for fsdp_param in self.params:
                    fsdp_param.register_sharded()
                    fsdp_param.free_unsharded()
                for rows in self.looked_up:
                    rows.end()
        self.shard_state = ShardState.HOST_SHARDED if keep else ShardState.SHARDED
        self.prefetched = False

    def summon(self) -> None:
        """Register every parameter's full value in its masters' own dtype, for ``summon_full_params`` (a collective;
        see [Note: summoned parameters are the masters] in ``param.py``). The forward's gathers are untouched."""
        self._move("show its full parameters")
        if self.summoned:
            raise RuntimeError(
                f"summon_full_params was entered again for unit '{self.name}' while it is already inside one; "
                "nest no summon_full_params over the same modules (one block shows every parameter)."
            )
        if self.shard_state is not ShardState.SHARDED:
            self.reshard()
        with record_function("lightning_fsdp.summon"), torch.no_grad():
            for fsdp_param, full in gather_masters(self.params, self.wholes):
                fsdp_param.register_summoned(full)
        self.summoned = True

    def end_summon(self, writeback: bool) -> None:
        """Leave ``summon_full_params``: copy this rank's rows back (``writeback``) and register the shards again."""
        self.reshard()  # a forward run inside the block may have gathered the unit
        for fsdp_param in self.params:
            fsdp_param.end_summon(writeback)
        self.summoned = False

    # ----- gradients -------------------------------------------------------------------------------------------

    def grad_params(self) -> list[nn.Parameter]:
        """The tensors autograd accumulates this unit's gradients into: full tensors, or the replicated params."""
        if self.params:
            return [fsdp_param.unsharded for fsdp_param in self.params]
        return list(self.replicated)

    def num_trainable(self) -> int:
        return sum(p.requires_grad for p in self.params) + sum(p.requires_grad for p in self.replicated)

    def has_frozen_sharded_params(self) -> bool:
        """Whether a parameter whose full tensor is freed after backward takes no gradient (backward may still
        read it after every trainable gradient is in)."""
        return not self.is_whole and any(not p.requires_grad for p in self.params)

    def reduce_grads(self) -> PendingGradReduction | None:
        """Launch the one gradient collective of this unit; frozen parameters take no part in it."""
        if self.is_whole:  # the gradients autograd accumulated are the final ones
            return None
        with record_function("lightning_fsdp.reduce_grads"):
            if self.params:
                trainable = [p for p in self.params if p.requires_grad and id(p) not in self.reduced_early]
                return self._reduce_scatter_grads(trainable) if trainable else None
            return self._all_reduce_grads()

    def _reduce_scatter_grads(self, trainable: list[FSDPParam]) -> PendingGradReduction:
        spread = [p for p in trainable if p.layout.owner is None]
        rows, had_grad = [], []
        for fsdp_param in spread:
            grad = fsdp_param.unsharded.grad
            had_grad.append(grad is not None)
            flat = fsdp_param.flat(grad) if grad is not None else fsdp_param.unsharded.new_empty(0)  # empty: zeros
            sparse_rows = fsdp_param.layout.row_numel if fsdp_param.rows_sparse else 0
            rows.append(RankRows(flat, fsdp_param.layout.shard_numel, sparse_rows))
        wholes, taking = [], {id(p) for p in trainable}
        for whole in self.wholes:
            packed = [p for p in whole.params if id(p) in taking]
            if packed:
                rows.append(whole.grad_rows(packed))
                wholes.append((whole, packed, [p.unsharded.grad is not None for p in packed]))
        reduce_dtype = self.options.mixed_precision.effective_reduce_dtype or rows[0].flat.dtype
        numel = self.world_size * sum(row.columns for row in rows)
        stamp = self.stamp("reduce-scatter", numel, reduce_dtype) if self.world_size > 1 else None
        transport = self.transport()
        divide_by = divide_before_reducing(reduce_dtype, self.total_world_size)
        if divide_by is None and transport.divides_exactly(self.total_world_size, rows, reduce_dtype):
            divide_by = self.total_world_size
        started = time.perf_counter()
        with torch.no_grad():  # the cast to reduce_dtype, if any, is the transport's packing copy
            pending = transport.reduce_scatter(rows, reduce_dtype, stamp, divide_by)
            if self.replicate_group is not None:  # HYBRID: sum the shard over the replicas too
                pending = self._sum_over_replicas(pending, transport.synchronous, row_regions(spread))
        STEP_STATS.blocked_since(started)
        STEP_STATS.reduced(self.name, transport.name, numel * reduce_dtype.itemsize)
        for fsdp_param in trainable:
            fsdp_param.unsharded.grad = None
        divide_after = self.total_world_size if divide_by is None else None
        return PendingGradReduction(pending, spread, had_grad, divide_after, wholes)

    def _sum_over_replicas(
        self, shard_sum: Pending[torch.Tensor], shard_stage_done: bool, row_regions: list[RowRegion]
    ) -> Pending[torch.Tensor]:
        """HYBRID's second stage. When the shard group's reduction is done on return (shared memory inside a host),
        the all-reduce over the replicas -- the stage that crosses hosts -- starts now and runs on gloo's threads
        behind the next units' backward; otherwise it starts when the shard stage is waited for. Between hosts an
        embedding's gradient goes by its non-zero rows (see [Note: an embedding's rows between hosts])."""

        def start() -> Pending[torch.Tensor]:
            reduced = shard_sum.wait()
            stamp = self.stamp("all-reduce", reduced.numel(), reduced.dtype)
            transport = self.replicate_transport()
            if row_regions and transport.crosses_hosts:
                return sum_over_replicas_by_rows(transport, reduced, row_regions, stamp, self.name)
            STEP_STATS.reduced(self.name, transport.name, reduced.numel() * reduced.dtype.itemsize)
            return transport.all_reduce([reduced], reduced.dtype, stamp)

        if shard_stage_done:
            return start()
        return Pending(lambda: start().wait())

    def _all_reduce_grads(self) -> PendingGradReduction | None:
        trainable = [p for p in self.replicated if p.requires_grad]
        if not trainable:
            return None
        had_grad = [param.grad is not None for param in trainable]
        reduce_dtype = self.options.mixed_precision.effective_reduce_dtype or trainable[0].dtype
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in trainable]
        numel = sum(grad.numel() for grad in grads)
        stamp = self.stamp("all-reduce", numel, reduce_dtype) if self.total_world_size > 1 else None
        divide_by = divide_before_reducing(reduce_dtype, self.total_world_size)
        transport = self.replicate_transport()
        started = time.perf_counter()
        with torch.no_grad():
            pending = transport.all_reduce(grads, reduce_dtype, stamp, divide_by)
        STEP_STATS.blocked_since(started)
        STEP_STATS.reduced(self.name, transport.name, numel * reduce_dtype.itemsize)
        divide_after = self.total_world_size if divide_by is None else None
        return PendingGradReduction(pending, trainable, had_grad, divide_after)
