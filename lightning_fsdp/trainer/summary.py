"""The model summary at full size: Lightning counts ``p.numel()``, which for a sharded model is one rank's rows.

:class:`~lightning_fsdp.FSDPStrategy` swaps Lightning's own summary callbacks (the plain and the rich one) for the
subclasses here when it sets up, so the table and the "Total params" line the user reads describe the model they
built, not a 1/W slice of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from typing_extensions import override

from lightning_fsdp.engine.runtime.registry import fsdp_param_of


def full_numel(parameters: Iterable[nn.Parameter]) -> int:
    """The number of elements of the full, unsharded parameters (a local shard counts as its whole parameter)."""
    total = 0
    for param in parameters:
        fsdp_param = fsdp_param_of(param)
        total += fsdp_param.shape.numel() if fsdp_param is not None else param.numel()
    return total


class FSDPSummary(ModelSummary):
    """Lightning's :class:`~lightning.pytorch.utilities.model_summary.ModelSummary`, counting full parameters."""

    @property
    @override
    def param_nums(self) -> list[int]:
        modules = dict(self._model.named_modules())
        return [full_numel(modules[name].parameters()) for name in self.layer_names]

    @property
    @override
    def total_parameters(self) -> int:
        return full_numel(self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return full_numel(p for p in self._model.parameters() if p.requires_grad)


class FSDPModelSummary(ModelSummaryCallback):
    """Lightning's ``ModelSummary`` callback, printing an :class:`FSDPSummary`."""

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FSDPSummary:
        return FSDPSummary(pl_module, max_depth=self._max_depth)


class FSDPRichModelSummary(RichModelSummary):
    """Lightning's ``RichModelSummary`` callback (the default when ``rich`` is installed), printing an
    :class:`FSDPSummary`."""

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> FSDPSummary:
        return FSDPSummary(pl_module, max_depth=self._max_depth)


_FULL_SIZE_VERSION = {ModelSummaryCallback: FSDPModelSummary, RichModelSummary: FSDPRichModelSummary}


def use_full_size_summaries(trainer: pl.Trainer) -> None:
    """Replace Lightning's own summary callbacks with the full-size ones, keeping their options.

    Only the exact Lightning classes are replaced; a user's subclass is theirs to keep.
    """
    for index, callback in enumerate(trainer.callbacks):
        replacement = _FULL_SIZE_VERSION.get(type(callback))
        if replacement is not None:
            trainer.callbacks[index] = replacement(callback._max_depth, **callback._summarize_kwargs)
