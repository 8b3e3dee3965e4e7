"""Collectives through shared memory between the CPU ranks of one host, with no message: every rank maps every other
rank's segment (``segment.py``), cut into slots (``slots.py``) and homes where units keep their shards (``homes.py``);
ranks publish and read through counters (``peer_wait.py``); ``transport.py`` is the transport itself."""

from lightning_fsdp.engine.transport.shm.segment import ENV_SWITCH, SEGMENT_NAME, enabled, timeout_of
from lightning_fsdp.engine.transport.shm.slots import SLOTS
from lightning_fsdp.engine.transport.shm.transport import SharedMemoryTransport

__all__ = ["ENV_SWITCH", "SEGMENT_NAME", "SLOTS", "SharedMemoryTransport", "enabled", "timeout_of"]
