"""A unit's parameters that live whole on one rank each, for optimizers that read whole tensors.

[Note: whole tensors] An optimizer that reads a whole tensor to update it -- Muon's Newton-Schulz, Adafactor's row and
column statistics, LAMB's trust ratio, Shampoo's preconditioners, 8-bit states quantized in blocks -- computes
something else on a rank's dim-0 rows. Such a parameter lives whole on one *owner* rank instead: there its shard is
the full tensor, on every other rank an empty one that never gets a gradient, so the optimizer (which skips a
parameter without one) steps it exactly once in the shard group, with no collective inside ``step()``. Which
parameters need it is decided per optimizer before its first step (``optimizers/``).

A unit's whole tensors are packed side by side, each rank's own in a *segment* of ``columns`` elements (the fullest
rank's; the others are padded), and to the transports that segment is one more shard of the unit: it rides in the
unit's one all-gather and one reduce-scatter, so every transport carries it unchanged and the collectives stay one
per unit. The gathered buffer holds every rank's segment; each parameter's full tensor is a view of its place there,
so all of them are allocated and freed together. Owners are planned in ``optimizers/owners.py``.
"""

from __future__ import annotations

import torch

from lightning_fsdp.engine.runtime.param import FSDPParam
from lightning_fsdp.engine.transport.packing import RankRows

ALIGN = 16  # elements: every tensor starts at a multiple of it in its segment, so copies stay vector-aligned


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN) * ALIGN


class WholeTensors:
    """The parameters of one unit held whole, by owner, as one more shard of the unit's collectives.

    ``params[i]`` lives on rank ``owners[i]`` at element ``offsets[i]`` of that rank's segment. Built from the full
    values of the parameters (``full[i]``): every rank passes the same, and keeps its own tensors.
    """

    def __init__(
        self,
        params: list[FSDPParam],
        owners: list[int],
        full: list[torch.Tensor],
        gather_dtype: torch.dtype,
    ) -> None:
        first = params[0]
        self.params = params
        self.owners = owners
        self.world_size, self.rank = first.layout.world_size, first.layout.rank
        used = [0] * self.world_size
        self.offsets = []
        for fsdp_param, owner in zip(params, owners, strict=True):
            self.offsets.append(used[owner])
            used[owner] += _aligned(fsdp_param.shape.numel())
        self.columns = max(used)
        # The tensors in the order of their places in the gathered buffer (rank-major, then offset).
        self._in_place_order = sorted(range(len(params)), key=lambda i: (owners[i], self.offsets[i]))
        shard_device = first.sharded.device
        pin = shard_device.type == "cpu" and first.compute_device.type == "cuda"
        self._segment = torch.zeros(self.columns, dtype=first.sharded.dtype, device=shard_device, pin_memory=pin)
        self._gathered = torch.empty(self.world_size * self.columns, dtype=gather_dtype, device=first.compute_device)
        for fsdp_param, owner, offset, value in zip(params, owners, self.offsets, full, strict=True):
            numel = fsdp_param.shape.numel()
            mine = owner == self.rank
            shard = self._segment[offset : offset + numel] if mine else self._segment[:0]
            place = owner * self.columns + offset
            fsdp_param.hold_whole(owner, value, shard, self._gathered[place : place + numel], self._gathered)
        self.free_unsharded()

    @property
    def mine(self) -> list[FSDPParam]:
        """The parameters this rank holds."""
        return [p for p, owner in zip(self.params, self.owners, strict=True) if owner == self.rank]

    # ----- what the unit's collectives move -------------------------------------------------------------------------

    @property
    def padded_shard(self) -> torch.Tensor:
        """This rank's segment on the compute device, as packed for the all-gather; re-synced from any parameter
        whose ``.data`` the user replaced (the optimizer steps in place, so normally nothing is copied)."""
        for fsdp_param in self.mine:
            fsdp_param.resync_shard()
        return self._segment.to(self.params[0].compute_device, non_blocking=True)

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """Every rank's segment, rank-major: where the all-gather puts them and the full tensors are views."""
        return self._gathered

    def alloc_unsharded(self) -> None:
        self.params[0].alloc_unsharded()

    def free_unsharded(self) -> None:
        self.params[0].free_unsharded()

    def move_to(self, home: torch.Tensor) -> None:
        """Keep this rank's segment in ``home`` (1-D, its numel and dtype) from now on; the parameters' shards become
        views of it (the same Parameters). See [Note: shards that live in shared memory] in
        ``transport/shm/homes.py``."""
        with torch.no_grad():
            home.copy_(self.padded_shard)
        self._segment = home
        for fsdp_param, offset in zip(self.params, self.offsets, strict=True):
            fsdp_param.point_shard_at(home[offset : offset + fsdp_param.sharded.numel()])

    def grad_rows(self, params: list[FSDPParam]) -> RankRows:
        """The gradients of ``params`` (some of this unit's whole tensors) packed rank-major for the reduce-scatter:
        each at its owner's segment, zeros elsewhere. One copy, the packing the transports would make anyway."""
        grads = [p.unsharded.grad for p in params]
        dtype = next((g.dtype for g in grads if g is not None), self._gathered.dtype)
        flat = torch.empty(self.world_size * self.columns, dtype=dtype, device=self._gathered.device)
        wanted = {id(p) for p in params}
        written = 0  # everything before it is written: copied or zeroed (one pass, not a fill and then copies)
        for index in self._in_place_order:
            fsdp_param, start = self.params[index], self.owners[index] * self.columns + self.offsets[index]
            grad = fsdp_param.unsharded.grad if id(fsdp_param) in wanted else None
            if grad is not None:
                flat[written:start].zero_()
                flat[start : start + grad.numel()].copy_(fsdp_param.flat(grad))
                written = start + grad.numel()
        flat[written:].zero_()
        return RankRows(flat, self.columns)

    def accept_reduced(self, segment: torch.Tensor, params: list[FSDPParam], had_grad: list[bool]) -> None:
        """This rank's reduced segment into the ``.grad`` of those of ``params`` it holds and that had a gradient."""
        arrived = {id(p) for p, got in zip(params, had_grad, strict=True) if got}
        for fsdp_param, owner, offset in zip(self.params, self.owners, self.offsets, strict=True):
            if owner == self.rank and id(fsdp_param) in arrived:
                fsdp_param.accumulate_sharded_grad(segment[offset : offset + fsdp_param.shape.numel()])

    def full_values(self, gathered: torch.Tensor) -> list[tuple[FSDPParam, torch.Tensor]]:
        """Every parameter's full tensor, as views of ``gathered`` (every rank's segment, rank-major)."""
        values = []
        for fsdp_param, owner, offset in zip(self.params, self.owners, self.offsets, strict=True):
            start = owner * self.columns + offset
            flat = gathered[start : start + fsdp_param.shape.numel()]
            values.append((fsdp_param, fsdp_param.laid_out(flat, fsdp_param.shape)))
        return values

    def __repr__(self) -> str:
        return f"WholeTensors({len(self.params)} tensors, {self.columns} elements a rank)"
