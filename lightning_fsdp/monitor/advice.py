"""When an interval shows a problem a setting can fix, say which setting: exposed communication, a straggler, memory.

A warning needs the condition in two intervals in a row (memory: once is enough, an out-of-memory error does not wait
for a second look), so that one noisy interval -- a checkpoint, a garbage collection, a neighbour's burst on a
shared host -- does not send a user changing settings. Each code is given once per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_fsdp.monitor.interval import MIB

EXPOSED_COMMUNICATION, STRAGGLER, MEMORY = "exposed_communication", "straggler", "memory"
SMALL_UNIT_BYTES = 4 * MIB  # below this a collective's fixed costs weigh against its bytes (a shared-memory slot)


@dataclass(frozen=True)
class RunFacts:
    """What the advice depends on, known once the engine has named its units."""

    sharding_strategy: str | None  # None: the model is not sharded by this engine
    forward_prefetch: bool
    cpu_offload: bool
    hosts: int
    device: str


@dataclass(frozen=True)
class Advice:
    code: str
    message: str


class Advisor:
    """Reads every interval line and returns the warnings it now calls for, each code at most once."""

    def __init__(self, exposed_comm_warn: float, straggler_warn: float, memory_warn: float, facts: RunFacts) -> None:
        self.exposed_comm_warn, self.straggler_warn, self.memory_warn = exposed_comm_warn, straggler_warn, memory_warn
        self.facts = facts
        self.given: set[str] = set()
        self._exposed_before = False  # whether the previous interval was over the line
        self._straggler_before: int | None = None  # the previous interval's straggler, if it was over the line

    def review(self, interval: dict[str, Any]) -> list[Advice]:
        found = [self._exposed(interval), self._straggler(interval), self._memory(interval)]
        new = [advice for advice in found if advice is not None and advice.code not in self.given]
        self.given.update(advice.code for advice in new)
        return new

    def _exposed(self, interval: dict[str, Any]) -> Advice | None:
        worst = max(interval["ranks"], key=lambda r: r["exposed_comm_s"] / max(r["step_s"], 1e-12))
        fraction = worst["exposed_comm_s"] / max(worst["step_s"], 1e-12)
        over = fraction > self.exposed_comm_warn
        previous, self._exposed_before = self._exposed_before, over
        if not (over and previous):
            return None
        units = interval["units"].values()
        gathered = [u["gathered_bytes"] for u in units if u["gathered_bytes"]]
        facts, fixes = self.facts, []
        if facts.hosts > 1 and facts.sharding_strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            fixes.append(
                "sharding_strategy='HYBRID_SHARD' (gathers and reductions inside each host, one all-reduce "
                "of the shards between hosts)"
            )
        if not facts.forward_prefetch:
            fixes.append("forward_prefetch=True (each unit's all-gather overlaps the forward of the unit before it)")
        if gathered and sum(gathered) / len(gathered) < SMALL_UNIT_BYTES:
            fixes.append(
                "fewer, larger units (a coarser auto_wrap_policy: each collective has fixed costs that small "
                "units do not amortise)"
            )
        fixes.append("a larger batch per rank (more compute to hide each collective behind)")
        return Advice(
            EXPOSED_COMMUNICATION,
            f"Exposed communication took {fraction:.0%} of the step on rank {worst['rank']} for two intervals in a "
            f"row (warning above {self.exposed_comm_warn:.0%}): the ranks wait for bytes that compute does not hide. "
            f"Try {'; or '.join(fixes)}.",
        )

    def _straggler(self, interval: dict[str, Any]) -> Advice | None:
        straggler = interval["straggler"]
        over = straggler["slower_by"] > self.straggler_warn
        previous, self._straggler_before = self._straggler_before, (straggler["rank"] if over else None)
        if not over or previous != straggler["rank"]:
            return None
        waiting = max(r["peer_wait_s"] for r in interval["ranks"])
        return Advice(
            STRAGGLER,
            f"Rank {straggler['rank']} computed {straggler['slower_by']:.0%} of a step longer than the fastest rank "
            f"for two intervals in a row ({straggler['slower_by_s']:.3f} s a step; the others wait up to "
            f"{waiting:.3f} s a step for it in the collectives). Look at that rank: its batches (longer sequences or "
            "more samples than the others'), its host's load (other processes, OMP_NUM_THREADS times the ranks above "
            "the cores) or its device (a slower or throttled GPU); no sharding setting hides uneven work per rank.",
        )

    def _memory(self, interval: dict[str, Any]) -> Advice | None:
        worst = max(interval["ranks"], key=lambda r: r["peak_bytes"] / r["limit_bytes"])
        fraction = worst["peak_bytes"] / worst["limit_bytes"]
        if fraction <= self.memory_warn:
            return None
        fixes = [
            "activation checkpointing (activation_checkpointing_policy={Block}: activations are recomputed in "
            "backward instead of kept)"
        ]
        if self.facts.sharding_strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
            fixes.append("sharding_strategy='FULL_SHARD' (parameters freed after each unit's forward)")
        fixes.append("smaller units (a finer auto_wrap_policy: fewer parameters gathered at once)")
        if self.facts.device == "cuda" and not self.facts.cpu_offload:
            fixes.append("cpu_offload=True (parameters, gradients and optimizer state in CPU memory)")
        fixes.append("a smaller batch per rank")
        return Advice(
            MEMORY,
            f"Peak memory on rank {worst['rank']} reached {worst['peak_bytes'] / MIB:.0f} MiB, {fraction:.0%} of its "
            f"{worst['limit_bytes'] / MIB:.0f} MiB (warning above {self.memory_warn:.0%}). To lower it: "
            f"{'; '.join(fixes)}.",
        )
