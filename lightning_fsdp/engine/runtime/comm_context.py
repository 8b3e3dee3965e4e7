"""What a unit uses of the root it runs under: the transports, the ledger and whether a backward is running.

A root's context (``RootContext`` in ``root.py``) is this and the rest of what the root's units share -- the forward
order, the prefetches, the reductions in flight. A unit holds its root's context as a ``CommContext`` and uses only
this part, so ``unit.py`` does not import ``root.py``, which builds on it; the hooks, which drive the root, see the
whole ``RootContext`` (``hooks.context_of``).
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from lightning_fsdp.engine.transport import Transport
from lightning_fsdp.engine.transport.identity import Ledger


class CommContext:
    """The collectives' side of one root's run, shared by its units."""

    def __init__(self) -> None:
        self.transports: dict[int, Transport] = {}  # by id of the process group (see [Note: one transport per group])
        self.ledger: Ledger | None = None  # numbers the units' collectives (see [Note: collective identity])
        self.callback_queued = False  # a backward is running: its final callback is queued on the autograd engine

    def transport_of(self, group: ProcessGroup | None) -> Transport:
        """The transport the root chose for ``group``."""
        return self.transports[id(group)]
