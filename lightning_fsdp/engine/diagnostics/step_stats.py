"""What this process's units moved and how long they held the training thread: always on, read by the monitor.

A user whose sharded run is slower or larger than expected needs to see where the step goes -- which units move how many
bytes over which transport, and how long the training thread sat inside the collectives -- without running a profiler.
``lightning_fsdp.monitor.FSDPMonitor`` reads these counters every few steps; anything else may too. The counters only
ever grow: a reader keeps a :meth:`StepStats.snapshot` and subtracts it from a later one, so several readers never reset
each other. ``unit.py`` updates them at its transitions (see [Note: profiler labels] there); what each counter holds is
on :class:`StepStats`. Cost: a dictionary lookup, two integer additions and two ``time.perf_counter`` calls per
collective; no dispatch mode, no device synchronisation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["STEP_STATS", "TRANSPORT_KEYS", "StatsSnapshot", "StepStats", "Traffic", "transport_key"]

#: Short names of the transports (``Transport.name``), in the order the monitor reports them.
TRANSPORT_KEYS = ("shm", "gloo", "nccl", "two-stage", "link", "local")

_KEY_OF_NAME = {"shared memory": "shm", "gloo": "gloo", "NCCL": "nccl", "one rank": "local"}


def transport_key(name: str) -> str:
    """The short key of a transport's ``name``: the hierarchical transport's name starts with "two-stage", a link's
    (compressed collectives between hosts) with "gloo (" and its precision."""
    if name in _KEY_OF_NAME:
        return _KEY_OF_NAME[name]
    return "two-stage" if name.startswith("two-stage") else "link"


@dataclass
class Traffic:
    """Bytes this rank sent into all-gathers and into reductions (reduce-scatters and all-reduces)."""

    gathered_bytes: int = 0
    reduced_bytes: int = 0


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one moment; ``a - b`` is what happened between snapshot ``b`` and snapshot ``a``."""

    units: dict[str, Traffic] = field(default_factory=dict)
    transports: dict[str, Traffic] = field(default_factory=dict)
    blocked_s: float = 0.0

    def __sub__(self, earlier: StatsSnapshot) -> StatsSnapshot:
        def minus(now: dict[str, Traffic], then: dict[str, Traffic]) -> dict[str, Traffic]:
            zero = Traffic()
            return {
                key: Traffic(
                    t.gathered_bytes - then.get(key, zero).gathered_bytes,
                    t.reduced_bytes - then.get(key, zero).reduced_bytes,
                )
                for key, t in now.items()
            }

        return StatsSnapshot(
            minus(self.units, earlier.units),
            minus(self.transports, earlier.transports),
            self.blocked_s - earlier.blocked_s,
        )

    def __add__(self, other: StatsSnapshot) -> StatsSnapshot:
        def plus(left: dict[str, Traffic], right: dict[str, Traffic]) -> dict[str, Traffic]:
            zero = Traffic()
            return {
                key: Traffic(
                    left.get(key, zero).gathered_bytes + right.get(key, zero).gathered_bytes,
                    left.get(key, zero).reduced_bytes + right.get(key, zero).reduced_bytes,
                )
                for key in left.keys() | right.keys()
            }

        return StatsSnapshot(
            plus(self.units, other.units),
            plus(self.transports, other.transports),
            self.blocked_s + other.blocked_s,
        )


class StepStats:
    """This process's counters (one instance, :data:`STEP_STATS`): every root in the process adds to them.

    - bytes: this rank's payload, the convention of ``diagnostics/comm_stats.py`` -- the packed input shard of an
      all-gather, the full input of a reduce-scatter, the tensor of an all-reduce -- by unit (its name as the engine
      names units) and by transport (the short keys of :data:`TRANSPORT_KEYS`). HYBRID_SHARD's sum over replicas
      counts as reduced bytes of the unit, on the replicas' transport.
    - ``blocked_s``: seconds the training thread spent inside a transport's collective calls and in the units' waits
      (``wait_unshard``, ``wait_reduce``): packing, shared memory's copies and waits for a slot or for peers, gloo's
      waits. On CUDA a wait orders streams and returns at once, so there it measures the host's part only.
    """

    def __init__(self) -> None:
        self.units: dict[str, Traffic] = {}
        self.transports: dict[str, Traffic] = {key: Traffic() for key in TRANSPORT_KEYS}
        self.blocked_s = 0.0

    def _traffic(self, unit: str, transport: str) -> tuple[Traffic, Traffic]:
        by_unit = self.units.get(unit)
        if by_unit is None:
            by_unit = self.units[unit] = Traffic()
        return by_unit, self.transports[transport_key(transport)]

    def gathered(self, unit: str, transport: str, nbytes: int) -> None:
        """``unit`` issued an all-gather of ``nbytes`` (its packed shard) over the transport named ``transport``."""
        by_unit, by_transport = self._traffic(unit, transport)
        by_unit.gathered_bytes += nbytes
        by_transport.gathered_bytes += nbytes

    def reduced(self, unit: str, transport: str, nbytes: int) -> None:
        """``unit`` issued a reduce-scatter or all-reduce of ``nbytes`` (its full input) over ``transport``."""
        by_unit, by_transport = self._traffic(unit, transport)
        by_unit.reduced_bytes += nbytes
        by_transport.reduced_bytes += nbytes

    def blocked_since(self, started: float) -> None:
        """The training thread was inside a collective from ``started`` (``time.perf_counter()``) until now."""
        self.blocked_s += time.perf_counter() - started

    def snapshot(self) -> StatsSnapshot:
        def copy(traffic: dict[str, Traffic]) -> dict[str, Traffic]:
            return {key: Traffic(t.gathered_bytes, t.reduced_bytes) for key, t in traffic.items()}

        return StatsSnapshot(copy(self.units), copy(self.transports), self.blocked_s)


STEP_STATS = StepStats()
