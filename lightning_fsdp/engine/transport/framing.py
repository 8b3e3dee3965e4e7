"""What every transport's messages share: the flat all-gather under its name of each torch release, and the size of a
rank's frame (its data, then the collective's stamp: see [Note: stamps in the frames] in ``gloo.py``)."""

from __future__ import annotations

import torch.distributed as dist

from lightning_fsdp.engine.transport.identity import STAMP_BYTES, Stamp

# torch 2.13 renamed the flat-tensor all-gather; older releases only have the old name.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def frame_bytes(data_bytes: int, stamp: Stamp | None) -> int:
    """Bytes of one rank's frame: its data, then its stamp."""
    return data_bytes + (STAMP_BYTES if stamp is not None else 0)
