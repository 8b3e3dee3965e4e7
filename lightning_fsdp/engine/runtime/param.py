"""One parameter's two lives: the local dim-0 shard the optimizer owns, and the full tensor the forward uses.

``ShardLayout`` says which rows of the full tensor a rank holds; ``FSDPParam`` holds the shard (the master weights, in
the parameter's own dtype) and the full tensor (in ``param_dtype`` on the compute device), whose storage is freed
between uses. Its Notes sit above the code they explain: ``_init_whole`` ([Note: one rank keeps the parameter whole]),
``flat`` ([Note: memory formats are kept]), ``alloc_unsharded`` ([Note: storage freeing and tensor identity]) and
``register_summoned`` ([Note: summoned parameters are the masters]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_fsdp.engine.build.fingerprint import value_checksum


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows of one parameter lie: rows ``[start, start + local_rows)`` of the full tensor.

    Spread over the ranks (``owner`` None), rank r holds rows ``[r * chunk_rows, (r + 1) * chunk_rows)``; held whole
    (see [Note: whole tensors] in ``whole_tensors.py``), rank ``owner`` holds every row and the others none.
    """

    rows: int  # dim 0 of the full tensor (1 for a 0-dim parameter)
    row_numel: int  # elements per row
    chunk_rows: int  # rows per rank, padded: ceil(rows / world_size); every row for a tensor held whole
    world_size: int
    rank: int
    owner: int | None = None  # the rank holding the whole tensor; None: rows spread over the ranks

    @property
    def start(self) -> int:
        if self.owner is not None:
            return 0 if self.rank == self.owner else self.rows
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
        """This rank's rows of a tensor of the parameter's full shape, as a (local_rows, row_numel) view.

        ``torch.reshape`` rather than the method: a tensor-like (Lightning's ``lazy_load`` of a file) is read here."""
        return torch.reshape(full, (self.rows, self.row_numel))[self.row_range]

    def unpad(self, by_rank: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Every rank's padded shard (world_size, shard_numel) as the full tensor."""
        return by_rank.reshape(-1)[: shape.numel()].view(shape)

    @property
    def spans_ranks(self) -> bool:
        """Whether the rows lie on more than one rank: what an optimizer that reads whole tensors must not see."""
        return self.owner is None and self.world_size > 1 and self.rows > 1

    def held_by(self, owner: int) -> ShardLayout:
        """This layout with every row on ``owner``."""
        return replace(self, chunk_rows=self.rows, owner=owner)

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
        # An untied embedding's gradient is zero in every row no token looked up: see [Note: an embedding's rows
        # between hosts] in sparse_rows.py.
        self.rows_sparse = bool(owners) and all(
            isinstance(module, nn.Embedding) and name == "weight" for module, name in owners
        )
        self.dim_order = dim_order(param)  # see [Note: memory formats are kept]
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
        self.summoned: nn.Parameter | None = None  # the full master value inside summon_full_params

    # [Note: one rank keeps the parameter whole] When a parameter's rows are spread over one rank and its gradient is
    # summed over no other (world size 1), in its own dtype on its own device, its shard *is* the full tensor: the
    # parameter stays the very object the module registered, and the unit gathers, copies and reduces nothing. Forward
    # and backward then run as the plain module does, gradients stay where autograd accumulated them, and the optimizer
    # steps them in place; every API (state dicts, clipping, checkpoints) sees the same shapes and names as at any world
    # size. ``devices=1`` is how users debug, so it must cost what the plain module costs.
    def _init_whole(self, param: nn.Parameter) -> None:
        dense = param.permute(self.dim_order).is_contiguous()
        whole = param if dense else nn.Parameter(param.detach().contiguous(), param.requires_grad)
        self.sharded = self.unsharded = whole
        self._padded_shard = self._unsharded_data = self.flat(whole.data)

    def _init_sharded(self, param: nn.Parameter, shard_device: torch.device, dtype: torch.dtype) -> None:
        layout = self.layout
        pin = shard_device.type == "cpu" and param.device.type == "cuda"
        # The padded local shard: what this rank packs into the unit's all-gather. Padding rows stay zero.
        self._padded_shard = torch.zeros(layout.shard_numel, dtype=param.dtype, device=shard_device, pin_memory=pin)
        n_local = layout.local_rows * layout.row_numel
        with torch.no_grad():
            start = layout.start * layout.row_numel
            self._padded_shard[:n_local].copy_(self.flat(param.detach())[start : start + n_local])
        shard = self.laid_out(self._padded_shard[:n_local], self._shard_shape())
        self.sharded = nn.Parameter(shard, param.requires_grad)
        # The full tensor lives in a padded buffer so the all-gather output copies into it in one fused op.
        padded_full = torch.empty(layout.padded_numel, dtype=dtype, device=self.compute_device)
        self.unsharded = nn.Parameter(self.laid_out(padded_full[: param.numel()], param.shape), param.requires_grad)
        self._unsharded_data = padded_full.data  # see [Note: storage freeing and tensor identity]
        self.free_unsharded()

    # [Note: memory formats are kept] A parameter whose rows (dim 0) are blocks of memory of their own -- any dense
    # layout with dim 0 outermost, such as a ``channels_last`` convolution weight -- keeps its memory format in all
    # three of its tensors: the shard, the unsharded tensor and the gathered master. Every flat buffer (the padded
    # shard, the all-gather's output, the gradient packed for the reduce-scatter, the reduced rows) holds the elements
    # in the parameter's memory order (``dim_order``), which row by row is the same split as the logical one, so nothing
    # else changes: gathering is the same one copy, and ``laid_out`` views the flat buffer with the original strides. A
    # gradient in another layout is packed in that order by a copy. A layout whose rows are not blocks of memory (a
    # transposed weight, dim 0 innermost) is kept contiguous.
    def flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this parameter's full shape or its shard's) as 1-D in the parameter's memory order: a view when
        it is laid out as the parameter, a copy otherwise (a gradient autograd made contiguous, say)."""
        if self.dim_order == sorted(self.dim_order):  # contiguous (and 0-dim parameters, whose shard is 1-D)
            return tensor.reshape(-1)
        return tensor.permute(self.dim_order).reshape(-1)

    def laid_out(self, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The 1-D ``flat`` (memory order) as a tensor of ``shape`` with the parameter's memory format (a view)."""
        order = self.dim_order
        if order == sorted(order):
            return flat.view(shape)
        return flat.view([shape[d] for d in order]).permute(sorted(range(len(order)), key=order.__getitem__))

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
        self.resync_shard()
        return self._padded_shard.to(self.compute_device, non_blocking=True)

    def resync_shard(self) -> None:
        """Copy the registered shard into the padded one if the user replaced its ``.data``."""
        if self.sharded.data_ptr() != self._padded_shard.data_ptr() and self.sharded.numel() > 0:
            self._padded_shard[: self.sharded.numel()].copy_(self.flat(self.sharded.detach()))

    def move_shard_to(self, home: torch.Tensor) -> None:
        """Keep the padded shard in ``home`` (1-D, its numel and dtype) from now on: the registered shard becomes a
        view of it (the same Parameter, so the optimizer's hold on it and its state stay), and the optimizer steps it
        there. See [Note: shards that live in shared memory] in ``transport/shm/homes.py``."""
        with torch.no_grad():
            home.copy_(self.padded_shard)
        self.point_shard_at(home)

    def point_shard_at(self, padded: torch.Tensor) -> None:
        """Make ``padded`` (1-D, holding this rank's shard first) the shard's memory, with no copy."""
        self._padded_shard = padded
        self.sharded.data = self.laid_out(padded[: self.sharded.numel()], self.sharded.shape)

    def hold_whole(
        self, owner: int, full: torch.Tensor, shard: torch.Tensor, gathered: torch.Tensor, buffer: torch.Tensor
    ) -> None:
        """Live whole on ``owner`` from now on (see [Note: whole tensors] in ``whole_tensors.py``), starting from the
        value ``full``. ``shard``: this rank's place in the unit's segment of whole tensors (the tensor's numel on the
        owner, empty elsewhere), which becomes the registered shard's memory; ``gathered``: the parameter's place in
        ``buffer``, the segments' gathered buffer (allocated now), which becomes the unsharded tensor's. Both
        Parameters keep their identity: the optimizer's hold on the shard, autograd's hooks on the full tensor stay."""
        self.layout = self.layout.held_by(owner)
        with torch.no_grad():
            if shard.numel():
                shard.copy_(self.flat(full))
        self._padded_shard = shard
        self.sharded.data = self.laid_out(shard, self._shard_shape())
        self.unsharded.data = self.laid_out(gathered, self.shape)
        self._unsharded_data = buffer.data  # shared by every whole tensor of the unit: allocated and freed together

    def _shard_shape(self) -> torch.Size:
        rest = self.shape[1:] if len(self.shape) > 0 else ()
        return torch.Size((self.layout.local_rows, *rest))

    @property
    def unsharded_buffer(self) -> torch.Tensor:
        """The padded full buffer the all-gather output is copied into (a ``.data`` alias; no version bumps)."""
        return self._unsharded_data

    # [Note: storage freeing and tensor identity] The unsharded parameter is created once and keeps its identity for the
    # life of the model: autograd saves it for backward, and post-accumulate-grad hooks are registered on it once.
    # Between uses only its *storage* is released (``untyped_storage().resize_(0)``) and re-allocated on the next
    # unshard, so the memory is given back while every saved reference stays a valid object. Data is written through
    # ``.data`` aliases, which have their own version counter: re-gathering the same values in backward must not look to
    # autograd like an in-place modification of a tensor it saved in forward.
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
        if not self.sharded.numel():  # no rows here: no gradient, which an optimizer skips (an empty one it may not)
            return
        grad = self.laid_out(reduced_shard[: self.sharded.numel()], self.sharded.shape)
        if self.sharded.grad is None:
            self.sharded.grad = grad.to(device=self.sharded.device, dtype=self.sharded.dtype)
        else:
            self.sharded.grad.add_(grad.to(self.sharded.device))

    # [Note: summoned parameters are the masters] ``summon_full_params`` shows each parameter as its full value gathered
    # from the shards in their own dtype (fp32 masters under mixed precision), as a tensor of its own: never the
    # forward's unsharded tensor, which holds ``param_dtype`` copies. Reading the model inside the block therefore sees
    # exactly the values the optimizer steps and a full state dict saves, and writing back on exit copies those same
    # values into the shards, so a read-only look changes no bit of any master weight; an edit sticks exactly as
    # written. The forward's unsharded tensors are left alone (freed), so training afterwards gathers in ``param_dtype``
    # as usual.
    def register_summoned(self, full: torch.Tensor) -> None:
        """Register ``full`` -- this parameter's full value in the masters' own dtype, gathered from the shards --
        for ``summon_full_params``; see [Note: summoned parameters are the masters].

        A parameter kept whole is its own full value already and stays registered as it is.
        """
        if self.is_whole:
            return
        if full.data_ptr() == self.sharded.data_ptr():  # the shard holds every row (NO_SHARD): a copy of its own
            full = full.clone()
        self.summoned = nn.Parameter(full, requires_grad=self.sharded.requires_grad)
        for module, name in self.owners:
            module._parameters[name] = self.summoned

    def end_summon(self, writeback: bool) -> None:
        """Register the shard again; with ``writeback``, copy this rank's rows of the summoned value into it first.

        The summoned value is in the shard's own dtype, so writing back rows nobody changed leaves them bit for bit
        as they were: only an edit changes the master weights.
        """
        if self.is_whole:
            return
        summoned, self.summoned = self.summoned, None
        if writeback:
            with torch.no_grad():
                shard = self.sharded.data
                shard.copy_(self.layout.local_rows_of(summoned.detach()).reshape(shard.shape))
        self.register_sharded()

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqn}, shape={tuple(self.shape)}, local_rows={self.layout.local_rows})"


def dim_order(param: torch.Tensor) -> list[int]:
    """The parameter's dimensions from outermost to innermost in memory, when its rows (dim 0) are blocks of memory
    of their own: any dense layout with dim 0 outermost (contiguous, ``channels_last``). Otherwise the contiguous
    order, in which the engine then keeps it (see [Note: memory formats are kept])."""
    contiguous = list(range(param.dim()))
    if param.dim() <= 1 or param.is_contiguous():
        return contiguous
    order = sorted(contiguous, key=lambda d: (-param.stride(d), d))
    if order[0] != 0 or not param.permute(order).is_contiguous():
        return contiguous
    return order
