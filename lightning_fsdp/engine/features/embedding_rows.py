"""An untied embedding gathered between hosts by the rows its lookups read, not whole.

When a unit's gathers cross hosts, the weight of an ``nn.Embedding`` that no other module shares is left out of a
training forward's gather, and a forward pre-hook on the embedding gathers exactly the rows its token ids name
(``LookedUpRows``). What that assumes, and how it is kept: [Note: an embedding's rows as they are looked up], above
``LookedUpRows``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_fsdp.engine.runtime.param import FSDPParam

GatherRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (wanted, shard rows, full rows)


# [Note: an embedding's rows as they are looked up] ``nn.Embedding``'s forward reads one row of its weight per token,
# and its backward reads none (the gradient of a lookup is the output's gradient scattered into rows). A step of a few
# thousand tokens reads a few thousand rows of a vocabulary of tens of thousands, yet a unit's gather moves every row of
# every rank: between hosts, where each byte costs link time, that is most of a language model's root unit for nothing.
# So when a unit's gathers cross hosts (``Transport.gathers_rows``), the weight of an ``nn.Embedding`` that no other
# module shares (``FSDPUnit.looked_up``) is left out of a training forward's gather: its full tensor is allocated and
# filled with NaN, and a forward pre-hook on the embedding, which sees the token ids, gathers exactly the rows they name
# from the ranks that hold them (``GlooTransport.gather_rows``: the wanted rows' marks ride in the stamps' gather, then
# each rank sends each peer the rows of its shard that peer wants). A second call in the same forward gathers only the
# rows not yet there. The lookups then compute with the same values a whole gather gives, to the bit.
#
# What that assumes, and how it is kept:
#
# - *Only the embedding's own forward reads the weight.* The parameter must belong only to ``nn.Embedding`` modules
#   whose forward is ``nn.Embedding``'s (``looks_up_rows_only``: a subclass that overrides it may read the weight
#   otherwise; ``max_norm`` rewrites rows; a head tied to it reads every row). Code that reads ``embedding.weight``
#   itself inside a training forward (a norm of the whole table, say) reads NaN in every row no token named: the loss
#   turns NaN at once instead of training on wrong values. Such a model passes ``gather_embedding_rows=False``
#   (docs/multi-node.md).
# - *Every rank looks up as often as the others.* Each lookup is a collective of the unit, stamped as any other, so a
#   rank that looks up more often than its peers raises ``CollectiveMismatchError`` instead of reading another
#   collective's data.
# - *Evaluation gathers whole.* A forward without gradients (validation, prediction) gathers the weight whole: a rank
#   serving its peers' evaluation forward (``uneven_evaluation.py``) runs no module code, so it could take part in no
#   lookup. Backward needs no row at all: a unit gathered again for backward leaves the weight unfilled (NaN), which
#   nothing reads; activation checkpointing's recomputation looks up again, on every rank alike.
class LookedUpRows:
    """One embedding weight of a unit whose full tensor is filled row by row, by the lookups of one gather."""

    def __init__(self, fsdp_param: FSDPParam, gather_rows: GatherRows, shows_full_params: Callable[[], bool]) -> None:
        self.param = fsdp_param
        self._gather_rows = gather_rows  # the unit's collective: ``FSDPUnit.gather_rows``
        self.shows_full_params = shows_full_params
        self.active = False  # this gather left the weight out: lookups fill it
        self.filled: torch.Tensor | None = None  # one byte a row of the padded full tensor: 1 once it is there
        self.handles: list[RemovableHandle] = [
            module.register_forward_pre_hook(functools.partial(_look_up, self), with_kwargs=True)
            for module, _ in fsdp_param.owners
        ]

    def begin(self, active: bool) -> None:
        """The unit's gather starts; with ``active`` the weight is not part of it (see the Note)."""
        self.active = active
        self.filled = None
        if active:
            buffer = self.param.unsharded_buffer
            buffer.fill_(float("nan") if buffer.is_floating_point() else 0)
            layout = self.param.layout
            self.filled = torch.zeros(layout.world_size * layout.chunk_rows, dtype=torch.uint8)

    def end(self) -> None:
        """The full tensor is freed: lookups leave it alone until the next gather."""
        self.active = False
        self.filled = None

    def fill(self, ids: torch.Tensor) -> None:
        """Gather the rows ``ids`` name that are not there yet (a collective: every rank calls it alike)."""
        layout = self.param.layout
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < layout.rows)]  # out of range: left for the lookup's own error
        wanted = torch.zeros_like(self.filled)
        wanted[ids] = 1
        wanted.mul_(1 - self.filled)
        self.filled.add_(wanted)
        full = self.param.unsharded_buffer.view(-1, layout.row_numel)
        shard = self.param.padded_shard.view(-1, layout.row_numel)
        self._gather_rows(wanted, shard, full)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def looks_up_rows_only(fsdp_param: FSDPParam) -> bool:
    """Whether only ``nn.Embedding``'s own lookup reads the parameter (see the Note)."""
    return bool(fsdp_param.owners) and all(
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and name == "weight"
        and module.max_norm is None
        and not module.sparse
        for module, name in fsdp_param.owners
    )


@torch.compiler.disable  # a collective with Python side effects, as the engine's other hooks
def _look_up(rows: LookedUpRows, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if rows.active and rows.shows_full_params():
        rows.fill(args[0] if args else kwargs["input"])
