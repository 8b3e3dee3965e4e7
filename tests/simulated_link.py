"""A link between simulated hosts inside a network namespace a test made itself: every host sends to the others
through a NIC of its own (an HTB class on the namespace's loopback), traffic between two ranks of one host goes
through a class of its own at loopback speed, and each socket's own count of the bytes it received (``ss -ti``:
exact payload, whatever the qdisc does) says what crossed and what stayed inside.

Which TCP connection joins which hosts is read from the ranks' file descriptors and ``/proc/net/tcp[6]``; each
connection between two hosts gets a u32 filter per direction on its exact port pair, classified onto the sender's
NIC. Run as root inside ``unshare --net`` (``tests/test_simulated_link.py`` starts it that way); everything stays on
127.0.0.1.
"""

from __future__ import annotations

import os
import re
import subprocess

ESTABLISHED = "01"


def _tc(*args: str, stdin: str | None = None) -> str:
    result = subprocess.run(["tc", *args], input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _connections() -> list[tuple[int, int, int]]:
    """(local port, remote port, inode) of every established TCP socket of this namespace."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                columns = line.split()
                if columns[3] == ESTABLISHED:
                    local, remote = (int(address.rsplit(":", 1)[1], 16) for address in columns[1:3])
                    found.append((local, remote, int(columns[9])))
    return found


INSIDE = 100  # the class of the connections between two ranks of one host
INSIDE_RATE = "100gbit"  # beyond what loopback moves here: unshaped in effect


def install_link(hosts: int, rate: str) -> None:
    """``hosts`` NICs of ``rate`` (tc's units, e.g. ``"1gbit"``) on this namespace's loopback, and the class that
    counts what ranks of one host send each other."""
    _tc("qdisc", "replace", "dev", "lo", "root", "handle", "1:", "htb")  # unclassified: sent at once, unshaped
    for classid, limit in [*((host + 1, rate) for host in range(hosts)), (INSIDE, INSIDE_RATE)]:
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", f"1:{classid}", "htb", "rate", limit,
            "ceil", limit, "burst", "1mb", "quantum", "60000")  # fmt: skip


class HostLink:
    """The NICs ``install_link`` made, seen from one process of the namespace: it classifies and reads them."""

    def __init__(self) -> None:
        self._classified: dict[tuple[int, int], bool] = {}  # (local port, remote port) -> between ranks of one host

    def classify(self, host_of_pid: dict[int, int]) -> int:
        """Put every connection between the given processes not classified yet on its sender's NIC, or, between
        two of one host, on the inside class; returns how many."""
        rank_of_inode = {inode: pid for pid in host_of_pid for inode in _socket_inodes(pid)}
        connections = _connections()
        # By both ports: Linux gives two outgoing connections one local port when their destinations differ.
        pid_of_end = {
            (local, remote): rank_of_inode[inode] for local, remote, inode in connections if inode in rank_of_inode
        }
        filters = []
        for local, remote, inode in connections:
            sender, receiver = rank_of_inode.get(inode), pid_of_end.get((remote, local))
            if sender is None or receiver is None or sender == receiver or (local, remote) in self._classified:
                continue
            same_host = host_of_pid[sender] == host_of_pid[receiver]
            self._classified[local, remote] = same_host
            flow = INSIDE if same_host else host_of_pid[sender] + 1
            for protocol, priority, selector in (("ip", "1", "ip"), ("ipv6", "2", "ip6")):
                filters.append(
                    f"filter add dev lo parent 1: protocol {protocol} prio {priority} u32 match {selector} sport "
                    f"{local} 0xffff match {selector} dport {remote} 0xffff flowid 1:{flow}"
                )
        if filters:
            _tc("-batch", "-", stdin="\n".join(filters) + "\n")
        return len(filters) // 2

    def sent_bytes(self) -> tuple[int, int]:
        """Payload received so far over the connections ``classify`` saw (between hosts; between ranks of one host)."""
        received = _received_bytes()
        crossed = inside = 0
        for (local, remote), same_host in self._classified.items():
            got = received.get((remote, local), 0)  # what the receiving end of this sender's socket has read
            if same_host:
                inside += got
            else:
                crossed += got
        return crossed, inside


def _received_bytes() -> dict[tuple[int, int], int]:
    """(local port, remote port) -> bytes that socket received, for every established TCP socket here."""
    text = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True, check=True).stdout
    found = {}
    for local, remote, info in re.findall(r"\S+:(\d+)\s+\S+:(\d+)\s*\n(.*)", text):
        count = re.search(r"bytes_received:(\d+)", info)
        found[int(local), int(remote)] = int(count.group(1)) if count else 0
    return found
