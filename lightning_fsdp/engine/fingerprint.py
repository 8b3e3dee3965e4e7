"""Every rank must build the same model: one collective at the root's lazy init compares what each rank built.

Sharding takes rank r's rows from rank r's own model, so ranks that built different models -- another shape, another
number of units, or the same model initialised with another seed -- would train a mix of each rank's rows without
any collective noticing (a gather of equal byte counts cannot tell). The fingerprint of a model is its units in
order, their parameters' names, full shapes, dtypes and ``requires_grad``, and a checksum of each parameter's values
as they were when it was sharded (the moment rows were taken from each rank). Ranks compare a digest of it in one
small all-gather; only if the digests differ do they exchange the fingerprints to name the first difference.

A parameter written after sharding (a checkpoint loaded into the sharded model) is compared by structure only: its
sharding-time values no longer matter, the loaded ones are the same on every rank by construction.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ModelMismatchError(RuntimeError):
    """Ranks built different models (structure or initial values)."""


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


def check_same_model(prints: list[UnitPrint], group: ProcessGroup) -> None:
    """A collective over ``group``: raise ``ModelMismatchError`` on every rank if any rank built another model."""
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
                    f"parameter '{p.name}' of unit '{x.name}'), so sharding would train a mix of each rank's rows; "
                    "seed every rank alike before building the model (torch.manual_seed, lightning's "
                    "seed_everything) or pass sync_module_states=True to broadcast rank 0's values."
                )
    return None
