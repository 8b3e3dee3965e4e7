"""How a unit's collectives move their bytes: one interface (``base.py``), an implementation per medium (gloo between
hosts, shared memory inside one, NCCL on CUDA, one rank alone) and the choice among them (``selection.py``).

The core of the engine talks to ``Transport`` and ``Pending`` only; what else lives here (the identity stamps of
``identity.py``, the peer waits, the buffer pool, the collective counter) serves the transports or watches them.
"""

from lightning_fsdp.engine.transport.base import (
    CHUNK_SWITCH,
    PIPELINE,
    Pending,
    Transport,
    add_collective_hook,
    announce,
    chunk_limit,
)
from lightning_fsdp.engine.transport.selection import choose_transport, standalone_transport
from lightning_fsdp.engine.transport.single_rank import SingleRank

__all__ = [
    "CHUNK_SWITCH",
    "PIPELINE",
    "Pending",
    "SingleRank",
    "Transport",
    "add_collective_hook",
    "announce",
    "choose_transport",
    "chunk_limit",
    "standalone_transport",
]
