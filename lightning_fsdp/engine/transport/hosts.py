"""Which ranks of a process group share a host: what decides where shared memory may go and what crosses a link.

[Note: host identity] Two ranks share a host when they run under one kernel: the same hostname and the same boot id
(``/proc/sys/kernel/random/boot_id``, new at every boot, so two machines cloned from one image still differ).
``LIGHTNING_FSDP_HOST`` overrides it: containers of one machine whose hostnames differ can claim one host, and the
ranks of one machine can claim several (a simulated cluster, as the tests and benchmarks run one). Every rank of a group
learns every other rank's identity in one collective when the root picks the group's transport, and the rest follows
from it: shared memory among the ranks of one host only, gloo (or NCCL) between hosts, and a group whose hosts hold
the same number of its ranks, each host's consecutive, gets the hierarchical collectives (``hierarchical.py``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed import ProcessGroup

HOST_SWITCH = "LIGHTNING_FSDP_HOST"
BOOT_ID = "/proc/sys/kernel/random/boot_id"


def host_identity() -> str:
    """This process's host, as ranks compare it (see [Note: host identity])."""
    claimed = os.environ.get(HOST_SWITCH, "").strip()
    if claimed:
        return claimed
    try:
        with open(BOOT_ID) as boot:
            boot_id = boot.read().strip()
    except OSError:  # not Linux: the hostname alone
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


@dataclass(frozen=True)
class HostLayout:
    """The group ranks on each host, hosts in the order of their lowest group rank, and this rank's place."""

    hosts: tuple[tuple[int, ...], ...]
    rank: int

    @staticmethod
    def of(group: ProcessGroup) -> HostLayout:
        """A collective over ``group``: every rank's host identity."""
        identities: list[str | None] = [None] * group.size()
        dist.all_gather_object(identities, host_identity(), group=group)
        by_host: dict[str, list[int]] = {}
        for group_rank, identity in enumerate(identities):
            by_host.setdefault(str(identity), []).append(group_rank)
        return HostLayout(tuple(tuple(ranks) for ranks in by_host.values()), dist.get_rank(group))

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def single_host(self) -> bool:
        return self.num_hosts == 1

    @cached_property
    def ranks_per_host(self) -> int | None:
        """The group ranks every host holds, or None when hosts hold different numbers of them."""
        sizes = {len(ranks) for ranks in self.hosts}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def host_major(self) -> bool:
        """Equal hosts whose ranks are consecutive, host after host (as torchrun and SLURM number them): group rank
        ``h * L + l`` is rank ``l`` of host ``h``, the layout the hierarchical collectives are written for."""
        per_host = self.ranks_per_host
        if per_host is None:
            return False
        return all(ranks == tuple(range(h * per_host, (h + 1) * per_host)) for h, ranks in enumerate(self.hosts))

    @property
    def host_index(self) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_index(self) -> int:
        return self.hosts[self.host_index].index(self.rank)

    def describe(self) -> str:
        sizes = sorted({len(ranks) for ranks in self.hosts})
        per_host = str(sizes[0]) if len(sizes) == 1 else "-".join(map(str, sizes))
        return f"{self.num_hosts} host(s) x {per_host} rank(s)"
