"""What the units of one root share: the order a forward runs them in, the gathers prefetched, the reductions in flight,
the callback that ends backward, and the transports chosen at the root's lazy init (the one place for root-only
decisions; safe to run again).

Its Notes sit above the code they explain: ``_choose_transports`` ([Note: the link's queue]),
``gathered_when_backward_starts`` ([Note: the last unit stays gathered]) and ``reduce_early_grads``
([Note: gradients that arrive long before their unit's backward ends]).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.build.fingerprint import ParamPrint, UnitPrint, check_same_model, value_checksum
from lightning_fsdp.engine.features.module_buffers import broadcast_buffers
from lightning_fsdp.engine.options import BackwardPrefetch
from lightning_fsdp.engine.runtime.comm_context import CommContext
from lightning_fsdp.engine.runtime.grad_reduction import PendingGradReduction
from lightning_fsdp.engine.runtime.registry import units_under
from lightning_fsdp.engine.runtime.unit import FSDPUnit
from lightning_fsdp.engine.transport import Transport, choose_transport
from lightning_fsdp.engine.transport.identity import Ledger

log = logging.getLogger(__name__)

# At most this many units gathered ahead of their use (the rate limiter of ``limit_all_gathers``); across hosts also
# how many are prefetched (see [Note: the link's queue]).
MAX_PREFETCHED_UNITS = 2


class RootContext(CommContext):
    """State shared by all units under one root: forward order, reductions in flight, the end-of-backward callback,
    and the collectives' side its units use (``CommContext``)."""

    def __init__(self, root: FSDPUnit) -> None:
        super().__init__()
        self.root = root
        self.units: list[FSDPUnit] = []
        self.forward_order: list[FSDPUnit] = []
        self._position: dict[int, int] = {}
        self.order_frozen = False
        self.pending: deque[PendingGradReduction] = deque()
        self.early_grads: list[FSDPUnit] = []  # units holding gradients mid-backward (see reduce_early_grads)
        # Backwards finished so far, and their count when the root's outermost forward began: see [Note: backward
        # inside a forward].
        self.backwards_finished = 0
        self.backwards_before_forward = 0
        self.buffers_trained = False  # a training forward ran since the ranks last took rank 0's buffers
        # The units an evaluation forward entered, in order, root excluded: what ``serve_forward`` replays
        # (see [Note: serving the peers' forward] in uneven_evaluation.py). ``evaluation_units`` is the last whole one.
        self.evaluation_units: list[FSDPUnit] = []
        self._entering: list[FSDPUnit] | None = None
        # See [Note: the link's queue]; set once the transports are chosen.
        self.gathers_cross_hosts = False
        self.prefetch_depth = 1
        self.gathered_for_backward = 1  # see [Note: the last unit stays gathered]
        self.reductions_in_flight = 1

    def lazy_init(self) -> None:
        """Claim every unit under the root. Safe to call again: it only re-reads which units exist."""
        self.units = units_under(self.root.module)
        groups = {(id(unit.shard_group), id(unit.replicate_group)) for unit in self.units}
        if len(groups) > 1:
            raise ValueError(
                "units under one root use different process groups; pass the same process_group to every "
                "fully_shard call of one model."
            )
        module_names = {id(m): name for name, m in self.root.module.named_modules()}
        for unit in self.units:
            unit.claim(self, module_names.get(id(unit.module)) or "<root>", is_root=unit is self.root)
        groups = [g for g in (self.root.shard_group, self.root.replicate_group) if g is not None and g.size() > 1]
        if groups:
            self._check_same_model(groups)
            self.ledger = Ledger([unit.name for unit in self.units])
        self._choose_transports()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("lightning_fsdp: %s", self.describe())

    def _check_same_model(self, groups: list[ProcessGroup]) -> None:
        """One small collective per group (see ``fingerprint.py``): every rank must have built the same model.

        Values that differed were made rank 0's by ``fully_shard`` already (see [Note: different values are made
        rank 0's]); what this finds is a structure that differs across calls, or values changed on some ranks since.
        """
        param_names = {id(p): name for name, p in self.root.module.named_parameters()}
        prints = [_unit_print(unit, param_names) for unit in self.units]
        for group in groups:
            check_same_model(prints, group)

    # [Note: the link's queue] On one host a gather or reduction is done almost as soon as it is issued; across a link
    # it takes longer than the compute around it, and the link idles whenever nothing is queued behind the collective in
    # flight. So when a root's collectives cross hosts (``Transport.crosses_hosts``), it keeps the link's queue full:
    # the gathers of the next ``MAX_PREFETCHED_UNITS`` units (not one) are issued ahead in both directions, forward
    # prefetch is on unless the user turned it off (``forward_prefetch=None``, the default), and two reductions stay in
    # flight behind the current one instead of one. The rate limiter bounds the gathered units as always; what grows is
    # the reductions' send buffers alive at once (their cost: ``benchmarks/history.md``).
    def _choose_transports(self) -> None:
        """One transport per group the units communicate over, sized for the largest collective of each kind there
        (a collective over the group: this runs at the root's first forward, on every rank alike).

        Every unit counts, the root too: the shared-memory transport bounds its slots itself and streams a larger
        collective through them in chunks (see [Note: chunks] in ``transport/shm/slots.py``), so a language model's
        root -- its embedding and head, often the largest unit by far -- neither sizes the segment nor leaves shared
        memory.
        """
        root = self.root
        needs: dict[int, dict[str, int]] = {}
        for unit in self.units:
            _add_needs(needs, unit)
        precision = root.options.cross_host_precision
        shard_homes = tuple(sizes for sizes in (unit.shard_home_bytes() for unit in self.units) if sizes)
        for group in (root.shard_group, root.replicate_group):
            if id(group) not in self.transports:
                need, homes = needs[id(group)], shard_homes if group is root.shard_group else ()
                self.transports[id(group)] = choose_transport(group, root.compute_device(), need, precision, homes)
        for unit in self.units:
            unit.keep_shards_at_home(self.transports[id(unit.shard_group)])
            unit.resolve_after_forward(self.transports[id(unit.shard_group)])
            unit.choose_looked_up_rows(self.transports[id(unit.shard_group)])
        self.gathers_cross_hosts = self.transports[id(root.shard_group)].crosses_hosts
        reductions_cross = self.gathers_cross_hosts or self.transports[id(root.replicate_group)].crosses_hosts
        self.prefetch_depth = MAX_PREFETCHED_UNITS if self.gathers_cross_hosts else 1
        if self.gathers_cross_hosts and root.options.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            self.gathered_for_backward = 1 + self.prefetch_depth
        self.reductions_in_flight = 2 if reductions_cross else 1

    def describe(self) -> str:
        """One line on this root: its units, the largest send buffer of each collective, the transports."""
        largest: dict[str, int] = {}
        for unit in self.units:
            for kind, nbytes in unit.send_bytes().items():
                largest[kind] = max(largest.get(kind, 0), nbytes)
        sizes = ", ".join(f"{kind} {nbytes / 2**20:.2f} MiB" for kind, nbytes in sorted(largest.items()) if nbytes)
        transports = ", ".join(f"{t.name} x{t.world_size}" for t in self.transports.values())
        return (
            f"root {type(self.root.module).__name__}: {len(self.units)} units, largest send buffer per collective "
            f"({sizes or 'none'}), transports: {transports}"
        )

    def transport_of(self, group: ProcessGroup | None) -> Transport:
        """The transport chosen for ``group``, chosen again if ``relaid`` gave it up."""
        if id(group) not in self.transports:  # given up by ``relaid``: chosen again, on every rank at this same use
            self._choose_transports()
        return self.transports[id(group)]

    def relaid(self) -> None:
        """Some units now hold tensors whole (see [Note: whole tensors] in whole_tensors.py), between steps: a
        transport that keeps shards at home (shared memory) is given up, to be chosen again -- homes and all, for
        the new shards -- at its next use; the embeddings' lookups are chosen again for the rows that remain."""
        for group_id, transport in list(self.transports.items()):
            if transport.keeps_shards_at_home:
                for unit in self.units:
                    unit.move_shards_out_of(transport)
                del self.transports[group_id]
                transport.close()
        for unit in self.units:
            if id(unit.shard_group) in self.transports:
                unit.choose_looked_up_rows(self.transports[id(unit.shard_group)])

    def sync_buffers_for_evaluation(self, training: bool) -> None:
        """The first forward in eval mode after training: every rank takes rank 0's buffers, so that validation
        normalises with the one set of running statistics a checkpoint would hold (see [Note: buffers are rank 0's
        at every checkpoint] in module_buffers.py). Once per switch to evaluation, not per forward."""
        if training:
            self.buffers_trained = True
        elif self.buffers_trained:
            self.buffers_trained = False
            broadcast_buffers(self.root.module)

    def note_entered(self, unit: FSDPUnit, outermost: bool) -> None:
        """Record the units an evaluation forward (no gradients) enters, for ``serve_forward``."""
        if torch.is_grad_enabled():
            self._entering = None
        elif unit.is_root and outermost:
            self._entering = []
        elif self._entering is not None and not unit.is_root:
            self._entering.append(unit)

    def end_entering(self) -> None:
        if self._entering is not None:
            self.evaluation_units, self._entering = self._entering, None

    # ----- order and prefetch --------------------------------------------------------------------------------------

    def record_forward(self, unit: FSDPUnit) -> None:
        if not self.order_frozen and id(unit) not in self._position:
            self._position[id(unit)] = len(self.forward_order)
            self.forward_order.append(unit)

    # [Note: the last unit stays gathered] Backward starts with the unit forward ran last: resharding it after its
    # forward, only to gather it again a moment later, costs a whole gather and makes every rank wait for the slowest at
    # the very start of backward, for no memory saved (the peak of a step is in backward, where that unit is gathered
    # anyway). So once the forward order is known (after the first backward), a training forward leaves the last unit in
    # that order gathered, as torchtitan configures torch's FSDP2; backward uses it as it is, and the end of backward
    # reshards it with every other unit. Where the gathers cross hosts, backward's first unit prefetches the
    # ``prefetch_depth`` units before it (see [Note: the link's queue]), so those are gathered at the start of backward
    # as well: with ``BACKWARD_PRE`` the last ``1 + prefetch_depth`` units stay gathered, which saves their second trip
    # over the link. The memory is what backward's start holds anyway, except that those units now also coexist with the
    # first gradients of backward (a language model's output head, before its early reduction); its cost:
    # ``benchmarks/history.md``. ``backward_prefetch`` other than ``BACKWARD_PRE`` keeps only the last unit.
    def gathered_when_backward_starts(self, unit: FSDPUnit) -> bool:
        """Whether backward's first unit or its prefetches are ``unit`` (see [Note: the last unit stays gathered])."""
        return self.order_frozen and unit in self.forward_order[-self.gathered_for_backward :]

    def neighbour(self, unit: FSDPUnit, step: int) -> FSDPUnit | None:
        index = self._position.get(id(unit))
        if index is None or not 0 <= index + step < len(self.forward_order):
            return None
        return self.forward_order[index + step]

    def next_units(self, unit: FSDPUnit, direction: int) -> list[FSDPUnit]:
        """The units to gather ahead of ``unit`` in ``direction`` (+1 forward order, -1 backward's), nearest first:
        one, or ``prefetch_depth`` where the gathers cross hosts (see [Note: the link's queue])."""
        ahead = (self.neighbour(unit, direction * step) for step in range(1, self.prefetch_depth + 1))
        return [u for u in ahead if u is not None]

    def prefetches_forward(self, unit: FSDPUnit) -> bool:
        wanted = unit.options.forward_prefetch
        return (self.gathers_cross_hosts if wanted is None else wanted) and self.order_frozen

    def prefetch(self, unit: FSDPUnit | None) -> None:
        if unit is None or not unit.needs_gather:
            return
        if unit.options.limit_all_gathers and sum(u.prefetched for u in self.units) >= MAX_PREFETCHED_UNITS:
            return
        unit.prefetch()

    def unshard_for_use(self, unit: FSDPUnit, prefetch: list[FSDPUnit]) -> None:
        """Issue the unit's gather, then the prefetches' (so the unit's arrives first), then wait for the unit."""
        unit.unshard()
        for ahead in prefetch:
            self.prefetch(ahead)
        unit.use()

    # ----- gradients -----------------------------------------------------------------------------------------------

    def enqueue_reduction(self, reduction: PendingGradReduction | None) -> None:
        """Keep one reduction in flight behind the current one (two across a link: see [Note: the link's queue]):
        overlap without holding every send buffer."""
        if reduction is not None:
            self.pending.append(reduction)
        while len(self.pending) > self.reductions_in_flight:
            self.pending.popleft().finish()

    def note_early_grads(self, unit: FSDPUnit) -> None:
        """``unit`` got a gradient and its backward goes on: another unit's backward may start before it ends."""
        if unit not in self.early_grads:
            self.early_grads.append(unit)

    def forget_early_grads(self, unit: FSDPUnit) -> None:
        if unit in self.early_grads:
            self.early_grads.remove(unit)

    def post_backward(self, unit: FSDPUnit) -> None:
        """Stage 5: ``unit``'s backward is complete (see the notes on post-backward in ``hooks.py``)."""
        self.forget_early_grads(unit)
        if unit.options.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self.prefetch(self.neighbour(unit, -1))
        self.enqueue_reduction(unit.finish_backward())

    # [Note: gradients that arrive long before their unit's backward ends] A unit's backward ends where its forward
    # began, and a unit around others -- the root above all -- spans the whole backward: a language model's output head
    # (its largest tensor with the embedding) is the first gradient of the step, the embedding's the last. Reduced with
    # the unit's other gradients at the end, the head would keep its full weight and its full gradient alive through
    # every block's backward (the peak of the step) and its reduction could overlap nothing. But a gradient that has
    # arrived is complete: its post-accumulate hook fires once all its uses are summed, and no node of this backward
    # reads its parameter any more (each node that saved the parameter produced a gradient for it, so ran before). So
    # when another unit's backward begins, the gradients the units still in backward hold -- if there are at least
    # ``EARLY_REDUCTION_MIN_BYTES`` of them (``unit.py``), so that a collective of their own pays -- are reduced at once
    # in their own collective, queued behind as any reduction, and their full parameters freed (the shards registered);
    # the unit's own reduction at its end takes the rest. The units stay those the policy named. Not with gradient sync
    # off (nothing is reduced), inside a forward (manual optimisation: the rest of the forward reads the parameters), or
    # when a gradient arrives twice in one backward (a reentrant checkpoint's second graph: refused, the first was
    # reduced already).
    def reduce_early_grads(self, besides: FSDPUnit) -> None:
        """Another unit's backward begins: the gradients the units still in backward hold are complete, so reduce
        them now (see [Note: gradients that arrive long before their unit's backward ends])."""
        for unit in list(self.early_grads):
            if unit is not besides:
                reduction = unit.reduce_arrived_early()
                if reduction is not None:
                    self.early_grads.remove(unit)
                    self.enqueue_reduction(reduction)

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)

    def finalize_backward(self) -> None:
        """Stage 6: reduce the units backward reached but did not finish, wait for everything, reshard all."""
        ordered = list(reversed(self.forward_order)) + [u for u in self.units if id(u) not in self._position]
        for unit in ordered:
            if unit.backward_unfinished:
                self.post_backward(unit)
        while self.pending:
            self.pending.popleft().finish()
        self.early_grads.clear()
        self.reshard_all()
        self.order_frozen = True
        self.callback_queued = False
        self.backwards_finished += 1

    def reshard_all(self) -> None:
        """The end of a step (or of a forward without backward): every unit sharded, every transport's temporaries
        given back (between steps a rank holds its shards only) and its deferred checks run."""
        for unit in self.units:
            unit.end_step()
        for transport in self.transports.values():
            transport.end_step()

    def release(self) -> None:
        """The end of a run (see [Note: what a run gives back] in ``release.py``): every unit leaves this root,
        sharded, idle and its shards out of the transports' memory; every transport is closed. The root's next
        forward starts over with the lazy init of a new context."""
        self.pending.clear()
        self.early_grads.clear()
        for unit in self.units:
            unit.leave_run(self.transports.get(id(unit.shard_group)))
        transports, self.transports = self.transports, {}
        for transport in transports.values():
            transport.close()


def _unit_print(unit: FSDPUnit, name_of: dict[int, str]) -> UnitPrint:
    """What this rank built for ``unit``; ``name_of`` names the replicated parameters (by id)."""
    params = [
        ParamPrint(p.fqn, tuple(p.shape), str(p.sharded.dtype), p.requires_grad, p.checksum_if_unchanged())
        for p in unit.params
    ] + [
        ParamPrint(name_of.get(id(p), "?"), tuple(p.shape), str(p.dtype), p.requires_grad, value_checksum(p))
        for p in unit.replicated
    ]
    return UnitPrint(unit.name, type(unit.module).__name__, tuple(params))


def _add_needs(needs: dict[int, dict[str, int]], unit: FSDPUnit) -> None:
    """Raise ``needs`` (per group: the largest send buffer of each collective kind) to what ``unit`` sends."""
    sent = unit.send_bytes()
    shard = needs.setdefault(id(unit.shard_group), {})
    for kind in ("all_gather", "reduce_scatter"):
        shard[kind] = max(shard.get(kind, 0), sent.get(kind, 0))
    replicate = needs.setdefault(id(unit.replicate_group), {})
    replicate["all_reduce"] = max(replicate.get("all_reduce", 0), sent["all_reduce"])


def contexts_of(units: Iterable[FSDPUnit]) -> list[RootContext]:
    """The contexts of the roots ``units`` run under, each once (units no root has claimed yet have none)."""
    found: dict[int, RootContext] = {}
    for unit in units:
        if isinstance(unit.context, RootContext):
            found.setdefault(id(unit.context), unit.context)
    return list(found.values())
