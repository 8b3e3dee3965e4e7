"""Count the collectives a block of code issues, and the bytes each rank puts into them.

Communication volume (FULL_SHARD moves 3x the parameter bytes per step: 2 all-gathers and 1 reduce-scatter) and "exactly
one all-gather per unit" are properties the engine must keep, which timing cannot check and counting can: tests assert
on the counts, and ``benchmarks/bench_engine.py`` reports bytes per step for our engine, torch FSDP2 and DDP counted the
same way. How collectives are seen: ``CollectiveCounter``; what ``bytes`` means: ``CollectiveEvent``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_fsdp.engine.transport.base import add_collective_hook, inside_a_collective

__all__ = ["CollectiveCounter", "CollectiveEvent", "classify"]

#: Namespaces whose operators are collectives (or their functional, autograd and legacy functional forms).
_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"})

#: Operators in those namespaces that move no data of their own and are not recorded: waits, the NaN check,
#: and the identity op functional collectives wrap their async result in when autograd is on.
_IGNORED = frozenset({"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"})

#: Operator name (without namespace) -> (normalised kind, schema name of the input payload argument).
#: Names are the torch 2.13 schemas (``torch._C._dispatch_get_all_op_names()``); an operator missing here is
#: recorded as kind "other" with the bytes of all its tensor arguments, so a new torch op is never silently lost.
_OPS: dict[str, tuple[str, str | None]] = {
    # c10d: what ProcessGroup methods dispatch.
    "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_": ("all_gather", "input_tensors"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "input_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
    # _c10d_functional (and its autograd variants, which share names): what functional collectives dispatch.
    "all_gather_into_tensor": ("all_gather", "input"),
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
    "batch_p2p_ops": ("p2p", "tensors"),
}


@dataclass(frozen=True)
class CollectiveEvent:
    """One collective call as this rank issued it.

    ``numel`` and ``bytes`` sum over every tensor of the input payload (a coalesced op has several);
    ``dtype`` is that of the first one (None when there is none, as for a barrier). ``group_size`` is the
    number of ranks in the process group, None when it could not be resolved.

    ``bytes`` is the size (``numel * element_size``) of the tensors this rank passes as the op's input payload: the
    input shard of an all-gather, the full input of a reduce-scatter, the tensor of an all-reduce, the input of an
    all-to-all, the buffer of a broadcast (sent by the root, received by the others) and the buffer of a send or recv.
    It is the logical volume per rank, independent of the algorithm the backend uses on the wire (a ring all-reduce
    sends about 2x its input); that keeps it comparable across backends.
    """

    kind: str
    op: str
    bytes: int
    numel: int
    dtype: torch.dtype | None
    group_size: int | None


def classify(op_name: str) -> str:
    """The normalised kind of a collective operator name, e.g. ``"c10d::_allgather_base_"`` -> ``"all_gather"``."""
    name = op_name.split("::")[-1].split(".")[0]
    return _OPS.get(name, ("other", None))[0]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in an argument, flattening the ``Tensor[]`` and ``Tensor[][]`` forms c10d schemas use."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            yield from _tensors(item)


def _bind(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The operator's arguments by schema name, so the payload is found by name rather than by position."""
    bound = {arg.name: value for arg, value in zip(func._schema.arguments, args, strict=False)}
    bound.update(kwargs)
    return bound


def _group_size(bound: Mapping[str, Any]) -> int | None:
    """Size of the op's process group: c10d ops carry the group object, functional ones a size and/or a name."""
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    try:
        group = bound.get("process_group")
        if group is not None:
            # The dispatcher hands Python a TorchBind ScriptObject; unbox it to reach ProcessGroup.size().
            if not isinstance(group, dist.ProcessGroup):
                group = dist.ProcessGroup.unbox(group)
            return int(group.size())
        name = bound.get("group_name")
        if isinstance(name, str):
            return int(dist.distributed_c10d._resolve_process_group(name).size())
    except (RuntimeError, TypeError, ValueError, AttributeError):
        pass
    return None


def _event(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> CollectiveEvent:
    name = func._schema.name.split("::")[-1]
    kind, payload_arg = _OPS.get(name, ("other", None))
    bound = _bind(func, args, kwargs)
    if payload_arg is not None:
        payload = list(_tensors(bound.get(payload_arg)))
    elif kind == "other":
        payload = list(_tensors(list(bound.values())))
    else:  # a barrier: its tensor is a dummy, it moves no payload
        payload = []
    numel = sum(t.numel() for t in payload)
    nbytes = sum(t.numel() * t.element_size() for t in payload)
    dtype = payload[0].dtype if payload else None
    return CollectiveEvent(kind, func._schema.name, nbytes, numel, dtype, _group_size(bound))


class CollectiveCounter(TorchDispatchMode):
    """Context manager that records every collective dispatched while it is active, on this rank.

    Example::

        with CollectiveCounter() as comm:
            loss = model(x).sum()
            loss.backward()
        assert comm.counts["all_gather"] == 2 * num_units
        print(comm.bytes["reduce_scatter"], comm.events[0])

    ``counts`` and ``bytes`` are :class:`collections.Counter` keyed by kind ("all_gather", "reduce_scatter",
    "all_reduce", "all_to_all", "broadcast", "reduce", "gather", "scatter", "send", "recv", "p2p", "barrier",
    "other"), so a kind that never happened reads as 0. ``events`` keeps every call in issue order.
    The counter can be entered again after it exits; the records accumulate until :meth:`reset`.

    A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every operator that reaches the dispatcher while it
    is active. Every ``torch.distributed`` collective does: the Python API calls a ``ProcessGroup`` method that
    dispatches ``c10d::<op>`` (``dist.all_gather_single`` and the deprecated ``all_gather_into_tensor`` both become
    ``c10d::_allgather_base_``), and functional collectives dispatch ``_c10d_functional::<op>``. Dispatch modes are
    thread-local state that autograd carries into backward, so collectives issued from backward hooks are seen too, and
    so are the collectives a DTensor issues when it redistributes (see ``__torch_dispatch__``).
    ``torch.distributed.tensor.debug.CommDebugMode`` counts calls but not bytes, and reports the functional op names
    rather than the ``c10d`` ones; that is why it is not reused here.

    Cost: a dispatch mode intercepts every operator, not only collectives, which adds Python overhead to each op. Use it
    around a step you count, never around a step you time.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.events: list[CollectiveEvent] = []

    def __enter__(self) -> CollectiveCounter:
        # Collectives a transport moves outside torch.distributed (shared memory) reach no dispatcher op.
        self._transport_hook = add_collective_hook(self._record_transport_collective)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._transport_hook.remove()
        super().__exit__(*exc)

    def _record_transport_collective(self, kind: str, op: str, payload: torch.Tensor, group_size: int) -> None:
        """A collective announced by a transport (see ``add_collective_hook``), with the payload convention of the
        ``c10d`` op it replaces."""
        nbytes = payload.numel() * payload.element_size()
        self.record(CollectiveEvent(kind, op, nbytes, payload.numel(), payload.dtype, group_size))

    def reset(self) -> None:
        """Forget everything recorded so far (e.g. after warmup steps)."""
        self.counts.clear()
        self.bytes.clear()
        self.events.clear()

    def record(self, event: CollectiveEvent) -> None:
        """Add one event; public so that tests and tools can feed events they observed another way."""
        self.events.append(event)
        self.counts[event.kind] += 1
        self.bytes[event.kind] += event.bytes

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses, and while this method runs the mode is off, so the
            # collectives DTensor issues to redistribute (the all-reduce of a Partial norm in clipping, say)
            # would go unseen. Declining lets DTensor run first; it unwraps to plain tensors, whose ops,
            # collectives included, come back here with the mode on. CommDebugMode does the same. Only DTensor:
            # other subclasses (FakeTensor, used inside DTensor's sharding propagation) must not be declined,
            # they would decline in turn and the op would fail.
            return NotImplemented
        kwargs = kwargs or {}
        if (
            func.namespace in _NAMESPACES
            and func._schema.name.split("::")[-1] not in _IGNORED
            and not inside_a_collective()  # a transport's messages: it announces the collective they make up
        ):
            # Record before running: if the collective fails or hangs, the call was still issued.
            self.record(_event(func, args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        parts = ", ".join(f"{kind}: {self.counts[kind]} calls / {self.bytes[kind]} B" for kind in sorted(self.counts))
        return f"CollectiveCounter({parts})"
