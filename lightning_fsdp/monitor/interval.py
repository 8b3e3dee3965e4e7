"""One interval of the monitor: what each rank measured, sent in one small all-gather, and what the ranks' numbers
say together -- the split of a step into compute, exposed communication and waiting for peers, and the straggler.

[Note: splitting a step] A rank knows two things about its step: how long it took (``step_s``) and how long its
training thread sat inside the engine's collectives (``blocked_s``, see ``engine/diagnostics/step_stats.py``). The rest
is compute (model, optimizer, data between the engine's hooks). Blocked time is of two kinds it cannot tell apart on its
own: moving the bytes (exposed communication: compute did not hide it) and waiting for a slower rank to arrive at the
collective (peer wait). The slowest rank's compute tells them apart: a rank whose compute is shorter by ``d`` waits
about ``d`` for its peers every step, so its peer wait is ``min(blocked, slowest compute - its compute)`` and the rest
of its blocked time is exposed communication. The slowest rank itself waits for nobody. It is an estimate -- the
ranks' work is interleaved within a step, not one block -- but it needs one small collective per interval and nothing
per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fsdp.engine.diagnostics.step_stats import TRANSPORT_KEYS, StatsSnapshot
from lightning_fsdp.monitor.memory import MemoryReading

MIB = 2**20


@dataclass(frozen=True)
class RankSample:
    """What one rank measured over an interval: seconds per step, samples and tokens per second, and ``traffic``,
    what its units moved over the interval's ``steps``."""

    step_s: float
    blocked_s: float
    memory: MemoryReading
    samples_per_s: float | None
    tokens_per_s: float | None
    traffic: StatsSnapshot
    steps: int

    def to_row(self, units: Sequence[str]) -> torch.Tensor:
        """A fixed layout every rank shares (the units are the same on every rank): one float64 row, bytes per step."""
        zero, steps = (0, 0), self.steps
        by_unit = {name: (t.gathered_bytes / steps, t.reduced_bytes / steps) for name, t in self.traffic.units.items()}
        by_transport = {
            key: (t.gathered_bytes / steps, t.reduced_bytes / steps) for key, t in self.traffic.transports.items()
        }
        memory = self.memory
        values = [self.step_s, self.blocked_s, memory.peak_bytes, memory.resident_bytes, memory.limit_bytes]
        values += [math.nan if v is None else v for v in (self.samples_per_s, self.tokens_per_s)]
        values += [b for name in units for b in by_unit.get(name, zero)]
        values += [b for key in TRANSPORT_KEYS for b in by_transport.get(key, zero)]
        return torch.tensor(values, dtype=torch.float64)


def row_length(units: Sequence[str]) -> int:
    return 7 + 2 * len(units) + 2 * len(TRANSPORT_KEYS)


def combine(
    rows: torch.Tensor, units: Sequence[str], step: int, steps: int, time: float, mfu_of: Any
) -> dict[str, Any]:
    """The interval line of ``fsdp_monitor.jsonl`` from every rank's row (``rows``: world size x row length).

    ``units`` and ``transports`` are summed over ranks, per step; ``mfu_of(samples_per_s)`` is the model FLOP
    utilisation of the whole job's throughput, or None."""
    rows = rows.cpu().double()
    step_s, blocked = rows[:, 0].tolist(), rows[:, 1].tolist()
    compute = [max(s - b, 0.0) for s, b in zip(step_s, blocked, strict=True)]
    slowest = max(compute)
    peer_wait = [min(b, slowest - c) for b, c in zip(blocked, compute, strict=True)]  # see [Note: splitting a step]
    ranks = []
    for rank, row in enumerate(rows.tolist()):
        ranks.append(
            {
                "rank": rank,
                "step_s": step_s[rank],
                "compute_s": compute[rank],
                "exposed_comm_s": blocked[rank] - peer_wait[rank],
                "peer_wait_s": peer_wait[rank],
                "peak_bytes": int(row[2]),
                "resident_bytes": int(row[3]),
                "limit_bytes": int(row[4]),
                "samples_per_s": _number(row[5]),
                "tokens_per_s": _number(row[6]),
            }
        )
    summed = rows.sum(dim=0).tolist()
    n = len(units)
    by_unit = {
        name: {"gathered_bytes": round(summed[7 + 2 * i]), "reduced_bytes": round(summed[8 + 2 * i])}
        for i, name in enumerate(units)
    }
    first = 7 + 2 * n
    by_transport = {
        key: {"gathered_bytes": round(summed[first + 2 * i]), "reduced_bytes": round(summed[first + 1 + 2 * i])}
        for i, key in enumerate(TRANSPORT_KEYS)
        if summed[first + 2 * i] or summed[first + 1 + 2 * i]
    }
    straggler = compute.index(slowest)
    slower_by_s = slowest - min(compute)
    samples = _total(r["samples_per_s"] for r in ranks)
    return {
        "kind": "interval",
        "step": step,
        "steps": steps,
        "time": time,
        "ranks": ranks,
        "units": by_unit,
        "transports": by_transport,
        "straggler": {
            "rank": straggler,
            "slower_by_s": slower_by_s,
            "slower_by": slower_by_s / max(min(step_s), 1e-12),
        },
        "samples_per_s": samples,
        "tokens_per_s": _total(r["tokens_per_s"] for r in ranks),
        "mfu": mfu_of(samples) if samples is not None else None,
    }


def metrics_of(interval: dict[str, Any]) -> dict[str, float]:
    """The logger's view of an interval line: see ``METRICS`` in ``monitor.py`` for the names and their meaning."""
    ranks = interval["ranks"]
    first = ranks[0]
    per_step = interval["units"].values()
    metrics = {
        "fsdp/step_s": first["step_s"],
        "fsdp/compute_s": first["compute_s"],
        "fsdp/exposed_comm_s": first["exposed_comm_s"],
        "fsdp/peer_wait_s": first["peer_wait_s"],
        "fsdp/exposed_comm_s_max": max(r["exposed_comm_s"] for r in ranks),
        "fsdp/gathered_mb": sum(u["gathered_bytes"] for u in per_step) / MIB,
        "fsdp/reduced_mb": sum(u["reduced_bytes"] for u in per_step) / MIB,
        "fsdp/peak_mb": max(r["peak_bytes"] for r in ranks) / MIB,
        "fsdp/resident_mb": max(r["resident_bytes"] for r in ranks) / MIB,
        "fsdp/memory_fraction": max(r["peak_bytes"] / r["limit_bytes"] for r in ranks),
        "fsdp/straggler_rank": float(interval["straggler"]["rank"]),
        "fsdp/straggler_slower_by": interval["straggler"]["slower_by"],
        "fsdp/samples_per_s": interval["samples_per_s"],
        "fsdp/tokens_per_s": interval["tokens_per_s"],
        "fsdp/mfu": interval["mfu"],
    }
    return {name: float(value) for name, value in metrics.items() if value is not None}


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _total(values: Any) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)
