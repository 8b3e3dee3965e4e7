"""One parameter's two lives: the local dim-0 shard the optimizer owns, and the full tensor the forward uses.

[Note: storage freeing and tensor identity] The unsharded parameter is created once and keeps its identity for the
life of the model: autograd saves it for backward, and post-accumulate-grad hooks are registered on it once. Between
uses only its *storage* is released (``untyped_storage().resize_(0)``) and re-allocated on the next unshard, so the
memory is given back while every saved reference stays a valid object. Data is written through ``.data`` aliases,
which have their own version counter: re-gathering the same values in backward must not look to autograd like an
in-place modification of a tensor it saved in forward.

[Note: one rank keeps the parameter whole] When a parameter's rows are spread over one rank and its gradient is
summed over no other (world size 1), in its own dtype on its own device, its shard *is* the full tensor: the
parameter stays the very object the module registered, and the unit gathers, copies and reduces nothing. Forward
and backward then run as the plain module does, gradients stay where autograd accumulated them, and the optimizer
steps them in place; every API (state dicts, clipping, checkpoints) sees the same shapes and names as at any world
size. ``devices=1`` is how users debug, so it must cost what the plain module costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.fingerprint import value_checksum


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows of one parameter lie: rows ``[start, start + local_rows)`` of the full tensor."""

    rows: int  # dim 0 of the full tensor (1 for a 0-dim parameter)
    row_numel: int  # elements per row
    chunk_rows: int  # rows per rank, padded: ceil(rows / world_size)
    world_size: int
    rank: int

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk_rows, self.rows)

    @property
    def local_rows(self) -> int:
        return min(self.start + self.chunk_rows, self.rows) - self.start

    @property
    def shard_numel(self) -> int:
        """Elements each rank contributes to the unit's flat buffers, padding included."""
        return self.chunk_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def row_range(self) -> slice:
        """This rank's rows, to index anything with the parameter's rows on dim 0 (a file's lazy slice, say)."""
        return slice(self.start, self.start + self.local_rows)

    def local_rows_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor of the parameter's full shape, as a (local_rows, row_numel) view."""
        return full.reshape(self.rows, self.row_numel)[self.row_range]

    def unpad(self, by_rank: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Every rank's padded shard (world_size, shard_numel) as the full tensor."""
        return by_rank.reshape(-1)[: shape.numel()].view(shape)

    @staticmethod
    def for_shape(shape: torch.Size, rank: int, world_size: int) -> ShardLayout:
        rows = shape[0] if len(shape) > 0 else 1
        row_numel = math.prod(shape[1:]) if len(shape) > 0 else 1
        return ShardLayout(rows, row_numel, math.ceil(rows / world_size), world_size, rank)


class FSDPParam:
    """A sharded parameter: the registered local shard, and the full tensor materialised on demand.

    ``owners`` lists every (module, attribute) that registers the parameter, so that a parameter shared by two
    modules (a tied embedding and output head) is swapped on both at once. ``shard_group`` is None for a
    parameter kept whole on every rank (NO_SHARD under mixed precision or offload): a "shard" of all rows.
    The shard lives on ``shard_device`` (the CPU under offload) in the parameter's own dtype -- the master
    weights -- while the full tensor lives on ``compute_device`` in ``param_dtype``. ``alone``: the model runs
    on one rank only (nothing to gather or reduce).
    """

    def __init__(
        self,
        param: nn.Parameter,
        fqn: str,
        owners: list[tuple[nn.Module, str]],
        shard_group: ProcessGroup | None,
        param_dtype: torch.dtype | None = None,
        offload: bool = False,
        replicate_group: ProcessGroup | None = None,
        alone: bool = False,
    ):
        self.fqn = fqn
        self.owners = owners
        self.group = shard_group  # the ranks the rows are spread over
        self.replicate_group = replicate_group  # HYBRID_SHARD's replicas of those rows
        self.shape = param.shape
        rank, world_size = (dist.get_rank(shard_group), shard_group.size()) if shard_group is not None else (0, 1)
        self.layout = ShardLayout.for_shape(param.shape, rank, world_size)
        self.compute_device = param.device
        shard_device = torch.device("cpu") if offload else param.device
        # See [Note: one rank keeps the parameter whole]; ``alone``: no other rank holds or reduces this parameter.
        self.is_whole = alone and param_dtype in (None, param.dtype) and shard_device == param.device
        # The values every rank took its rows from (rank 0's where ranks differed: see [Note: different values are
        # made rank 0's] in fingerprint.py), for the check at the root's first forward.
        self.initial_checksum = None if alone else value_checksum(param)
        if self.is_whole:
            self._init_whole(param)
        else:
            self._init_sharded(param, shard_device, param_dtype or param.dtype)
        self._initial_version = self.sharded._version

    def _init_whole(self, param: nn.Parameter) -> None:
        whole = param if param.is_contiguous() else nn.Parameter(param.detach().contiguous(), param.requires_grad)
        self.sharded = self.unsharded = whole
        self._padded_shard = self._unsharded_data = whole.data.view(-1)

    def _init_sharded(self, param: nn.Parameter, shard_device: torch.device, dtype: torch.dtype) -> None:
        layout = self.layout
        pin = shard_device.type == "cpu" and param.device.type == "cuda"
        # The padded local shard: what this rank packs into the unit's all-gather. Padding rows stay zero.
        self._padded_shard = torch.zeros(layout.shard_numel, dtype=param.dtype, device=shard_device, pin_memory=pin)
        n_local = layout.local_rows * layout.row_numel
        with torch.no_grad():
            self._padded_shard[:n_local].copy_(layout.local_rows_of(param.detach()).reshape(-1))
        shard_shape = (layout.local_rows, *param.shape[1:]) if param.dim() > 0 else (layout.local_rows,)
        self.sharded = nn.Parameter(self._padded_shard[:n_local].view(shard_shape), requires_grad=param.requires_grad)
        # The full tensor lives in a padded buffer so the all-gather output copies into it in one fused op.
        padded_full = torch.empty(layout.padded_numel, dtype=dtype, device=self.compute_device)
        self.unsharded = nn.Parameter(padded_full[: param.numel()].view(param.shape), requires_grad=param.requires_grad)
        self._unsharded_data = padded_full.data  # see [Note: storage freeing and tensor identity]
        self.free_unsharded()

    def checksum_if_unchanged(self) -> int | None:
        """The sharding-time checksum, or None once the shard was written since (a checkpoint loaded into it)."""
        unchanged = self.sharded._version == self._initial_version
        return self.initial_checksum if unchanged else None

    @property
    def requires_grad(self) -> bool:
        return self.sharded.requires_grad

    @property
    def padded_shard(self) -> torch.Tensor:
        """The shard with padding, on the compute device, as packed for the all-gather.

        Re-synced first if the user replaced ``.data`` (the optimizer steps in place, so normally it is the same).
        """
        if self.sharded.data_ptr() != self._padded_shard.data_ptr() and self.sharded.numel() > 0:
            self._padded_shard[: self.sharded.numel()].copy_(self.sharded.detach().reshape(-1))
        return self._padded_shard.to(self.compute_device, non_blocking=True)

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """The padded full buffer the all-gather output is copied into (a ``.data`` alias; no version bumps)."""
        return self._unsharded_data

    def alloc_unsharded(self) -> None:
        if self.is_whole:
            return
        storage = self._unsharded_data.untyped_storage()
        nbytes = self._unsharded_data.numel() * self._unsharded_data.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def free_unsharded(self) -> None:
        if self.is_whole:  # the one tensor is the shard too: its memory is never given back
            return
        self._unsharded_data.untyped_storage().resize_(0)

    @property
    def is_unsharded_allocated(self) -> bool:
        return self._unsharded_data.untyped_storage().nbytes() > 0

    def register_sharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.sharded

    def register_unsharded(self) -> None:
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        for module, name in self.owners:
            module._parameters[name] = self.unsharded

    def accumulate_sharded_grad(self, reduced_shard: torch.Tensor) -> None:
        """Add this rank's reduced rows (a view of the unit's reduce output, padding included) to ``.grad``.

        The reduced gradient comes in ``reduce_dtype`` on the compute device; ``.grad`` is kept in the shard's
        own dtype and device (fp32 master gradients, in CPU memory under offload).
        """
        grad = reduced_shard[: self.sharded.numel()].view(self.sharded.shape)
        if self.sharded.grad is None:
            self.sharded.grad = grad.to(device=self.sharded.device, dtype=self.sharded.dtype)
        else:
            self.sharded.grad.add_(grad.to(self.sharded.device))

    def write_back_from_unsharded(self) -> None:
        """Copy this rank's rows of the (possibly user-modified) full tensor back into the shard."""
        if self.is_whole:  # they are one tensor
            return
        with torch.no_grad():
            rows = self.layout.local_rows_of(self.unsharded.data)
            self.sharded.data.reshape(-1).copy_(rows.reshape(-1).to(self.sharded.device))

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, shape={tuple(self.shape)}, local_rows={self.layout.local_rows})"
