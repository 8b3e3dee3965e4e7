"""Every rank must build the same model: what each rank built is compared, and different values are made rank 0's.

Sharding takes rank r's rows from rank r's own model, so ranks that built different models -- another shape, another
number of units, or the same model initialised with another seed -- would train a mix of each rank's rows without any
collective noticing (a gather of equal byte counts cannot tell). The fingerprint of a model is its units in order, their
parameters' names, full shapes, dtypes and ``requires_grad``, and a checksum of each parameter's values as they were
when it was sharded (the moment rows were taken from each rank). Ranks compare a digest of it in one small all-gather;
only if the digests differ do they exchange the fingerprints to name the first difference. Values that
differ: [Note: different values are made rank 0's], above ``check_same_structure``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ModelMismatchError(RuntimeError):
    """Ranks built different models (names, shapes, dtypes, units), or changed the sharded values differently."""


def value_checksum(tensor: torch.Tensor) -> int:
    """An exact checksum of the values: the integer sum of their bit patterns (independent of summation order)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return int(flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64))


@dataclass(frozen=True)
class ParamPrint:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    checksum: int | None  # None: written after sharding, compared by structure only

    def structure(self) -> tuple:
        return self.name, self.shape, self.dtype, self.requires_grad


@dataclass(frozen=True)
class UnitPrint:
    name: str
    kind: str  # the module's class
    params: tuple[ParamPrint, ...]


# [Note: different values are made rank 0's] Ranks that built the same structure with other values (an unseeded script:
# every process draws other numbers) are not refused: as DDP does at construction, every rank takes rank 0's parameters
# and buffers. That has to happen while every rank still holds its full tensors, so it happens in ``fully_shard``, not
# at the first forward: each call first compares the structure of what it will shard (``check_same_structure``, one
# small all-gather, before anything changes: a difference is refused by name), so that every rank then runs the same
# per-unit collectives; each unit, when its parameters are real (at once, or as deferred init materialises it), compares
# one digest of its parameters' checksums (``values_differ``, one all-gather of one integer per rank) and, only where
# some rank's differs, is broadcast from rank 0 before its rows are taken; the buffers likewise, once at the end of the
# call. Every rank decides from the gathered digests, so all take the same branch. ``sync_module_states=True``
# broadcasts without comparing. The checksum is a sum of bit patterns: values that are a permutation of each other
# within one tensor look alike (no seed produces that).
def check_same_structure(prints: list[UnitPrint], buffers: UnitPrint, group: ProcessGroup) -> None:
    """A collective over ``group``: raise ``ModelMismatchError`` on every rank if the units' or the ``buffers``'
    structures differ (values are not compared: see [Note: different values are made rank 0's])."""
    everyone: list[tuple[list[UnitPrint], UnitPrint] | None] = [None] * group.size()
    dist.all_gather_object(everyone, (prints, buffers), group=group)
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    (units_a, buffers_a), rank_a = everyone[0], ranks[0]
    for rank, (units_b, buffers_b) in zip(ranks[1:], everyone[1:], strict=True):
        message = _structure_difference(rank_a, units_a, rank, units_b)
        message = message or _structure_difference(rank_a, [buffers_a], rank, [buffers_b])
        if message is not None:
            raise ModelMismatchError(message.replace("holds other parameters", "holds other buffers"))


def values_differ(tensors: list[torch.Tensor], group: ProcessGroup) -> bool:
    """A collective over ``group``: whether any rank's ``tensors`` hold other values than the group's first rank's.

    One all-gather of one integer per rank (a digest of the tensors' checksums); every rank answers alike."""
    digest = hashlib.sha256(repr([value_checksum(t) for t in tensors]).encode()).digest()
    nccl = dist.get_backend(group) == dist.Backend.NCCL
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(everyone, mine, group=group)
    return any(not torch.equal(other, everyone[0]) for other in everyone[1:])


def check_same_model(prints: list[UnitPrint], group: ProcessGroup) -> None:
    """A collective over ``group``: raise ``ModelMismatchError`` on every rank if any rank built another model.

    A parameter written after sharding (a checkpoint loaded into the sharded model) is compared by structure only: its
    sharding-time values no longer matter, the loaded ones are the same on every rank by construction."""
    digest = hashlib.sha256(repr(prints).encode()).hexdigest()
    digests: list[str | None] = [None] * group.size()
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone: list[list[UnitPrint] | None] = [None] * group.size()
    dist.all_gather_object(everyone, prints, group=group)
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    for rank, other in zip(ranks[1:], everyone[1:], strict=True):
        message = _structure_difference(ranks[0], everyone[0], rank, other)
        if message is not None:
            raise ModelMismatchError(message)
    for rank, other in zip(ranks[1:], everyone[1:], strict=True):
        message = _value_difference(ranks[0], everyone[0], rank, other)
        if message is not None:
            raise ModelMismatchError(message)


_BUILD_ALIKE = "build the same model, wrapped by the same policy, on every rank"


def _structure_difference(rank_a: int, a: list[UnitPrint], rank_b: int, b: list[UnitPrint]) -> str | None:
    if len(a) != len(b):
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
        prefix = f"rank {rank_a} has {len(a)} sharding units but rank {rank_b} has {len(b)}"
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x.name != y.name), None)
        where = (
            f"first difference at unit #{first}: '{a[first].name}' on rank {rank_a}, '{b[first].name}' on rank {rank_b}"
            if first is not None
            else f"the first unit only one of them has is '{extra.name}' ({extra.kind})"
        )
        return f"{prefix} ({where}); {_BUILD_ALIKE}."
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if (x.name, x.kind) != (y.name, y.kind):
            return (
                f"unit #{index} is '{x.name}' ({x.kind}) on rank {rank_a} but '{y.name}' ({y.kind}) on rank {rank_b}; "
                f"{_BUILD_ALIKE}."
            )
        if len(x.params) != len(y.params) or any(p.name != q.name for p, q in zip(x.params, y.params, strict=False)):
            names_a, names_b = [p.name for p in x.params], [p.name for p in y.params]
            only = sorted(set(names_a) ^ set(names_b))[:3] or names_a[:3]
            return (
                f"unit '{x.name}' holds other parameters on rank {rank_a} ({len(names_a)}) than on rank {rank_b} "
                f"({len(names_b)}; differing: {only}); {_BUILD_ALIKE}."
            )
        for p, q in zip(x.params, y.params, strict=True):
            for field, value_a, value_b in (
                ("shape", p.shape, q.shape),
                ("dtype", p.dtype, q.dtype),
                ("requires_grad", p.requires_grad, q.requires_grad),
            ):
                if value_a != value_b:
                    return (
                        f"parameter '{p.name}' of unit '{x.name}' has {field} {value_a} on rank {rank_a} but "
                        f"{value_b} on rank {rank_b}; {_BUILD_ALIKE}."
                    )
    return None


def _value_difference(rank_a: int, a: list[UnitPrint], rank_b: int, b: list[UnitPrint]) -> str | None:
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x.params, y.params, strict=True):
            if p.checksum is not None and q.checksum is not None and p.checksum != q.checksum:
                return (
                    f"rank {rank_b} built the model with other initial values than rank {rank_a} (first difference: "
                    f"parameter '{p.name}' of unit '{x.name}') although fully_shard made them rank 0's, so they were "
                    "changed on some ranks after fully_shard; change a sharded model alike on every rank (load a "
                    "checkpoint, or write the same values everywhere)."
                )
    return None
