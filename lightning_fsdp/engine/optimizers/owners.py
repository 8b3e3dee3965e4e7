"""Which rank holds each tensor that lives whole (see [Note: whole tensors] in ``whole_tensors.py``).

Two things are balanced. Inside a unit, the bytes: every rank's segment is as long as the fullest one's, so an
uneven split pads the unit's collectives and memory. Over the model, the optimizer's work on the tensors a rank
holds: the largest tensor of a unit goes to the least-filled segment, and among equally filled ones to the rank that
has the least work so far, so units of the same shape (a transformer's blocks) take turns instead of loading one rank
with every block's largest matrix. Work is estimated as Newton-Schulz's ``rows * columns * min(rows, columns)``
(Muon's orthogonalisation, the costliest common whole-tensor step), linear for vectors. The plan depends only on
shapes, so every rank makes the same one.
"""

from __future__ import annotations

import math

import torch

from lightning_fsdp.engine.runtime.whole_tensors import ALIGN


def work_of(shape: torch.Size) -> int:
    """An estimate of an optimizer's work on a tensor held whole: its elements times its smaller side."""
    rows = shape[0] if len(shape) else 1
    columns = math.prod(shape[1:]) if len(shape) > 1 else 1
    return rows * columns * min(rows, columns)


def plan_owners(shapes: list[torch.Size], work: list[int]) -> list[int]:
    """The owner of each of one unit's tensors of ``shapes``, over ``len(work)`` ranks; ``work`` (each rank's work so
    far) is raised by what each rank now takes."""
    filled = [0] * len(work)
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-shapes[i].numel(), i)):
        numel = -(-shapes[index].numel() // ALIGN) * ALIGN
        rank = min(range(len(work)), key=lambda r: (filled[r], work[r], r))
        owners[index] = rank
        filled[rank] += numel
        work[rank] += work_of(shapes[index])
    return owners
