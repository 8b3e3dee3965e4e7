"""Ranks whose data ends at different points: evaluation finishes with every rank's batches, training stops with one
sentence, and nothing waits forever.

In evaluation a rank whose loop has ended serves its peers' forwards until every rank has ended (see
[Note: uneven evaluation] above ``UnevenData``). Training is not served: the ranks compare their batch counts at every
training epoch end, and a rank that ran fewer is named on every rank within seconds (``on_train_epoch_end``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_fsdp.adapter import watched_collectives
from lightning_fsdp.engine.diagnostics.hang_watch import set_phase
from lightning_fsdp.engine.features.uneven_evaluation import ranks_with_batch, serve_forward


# [Note: uneven evaluation] With ``use_distributed_sampler=False`` and per-rank data (per-rank shards, streaming
# datasets) ranks can have different numbers of validation, test or predict batches. Before every such batch each rank
# says it has one (an all-reduce of one integer, SUM: how many ranks still run a step); at the end of its loop a rank
# keeps answering "none" and, while others still have batches, serves each of their forwards
# (``engine/features/uneven_evaluation.py``): its shards go out to their gathers, the model is read-only, nothing is
# computed or logged. When the sum is 0 every rank has ended, and all go on together to the epoch-end hooks and
# Lightning's ``sync_dist``: each rank's results are those of its own batches, as under DDP. A rank's loop has ended at
# the end of the batch its loop marks as the last (``batch_progress.is_last_batch``, from the data fetcher that looks
# one batch ahead): right after ``on_*_batch_end`` (this callback goes first among the callbacks), before Lightning
# reduces the epoch's logged values. Cost: one round trip per evaluation batch, and one more per loop. Several
# evaluation dataloaders are served once, after the last one: Lightning reduces each dataloader's logged values when it
# moves to the next, so their lengths must agree across ranks except the last one's.
#
# A rank with no batch at all never enters Lightning's loop (it skips it), so it cannot serve: give each rank at least
# one batch. Each served forward replays the units of this rank's own last evaluation forward, so a step must run the
# model once (the redirected ``*_step`` is that one forward, however often it calls submodules) with the same units each
# time; otherwise the stamps raise ``CollectiveMismatchError`` (never a hang).
class UnevenData(Callback):
    """See [Note: uneven evaluation]. The strategy puts it first in ``trainer.callbacks`` at setup."""

    def __init__(self) -> None:
        self._train_batches = 0

    # ----- evaluation: every rank's batches, then all together ------------------------------------------------------

    def _step_coming(self, trainer: pl.Trainer) -> None:
        set_phase(None)
        ranks_with_batch(1, trainer.strategy.root_device)

    def _serve_until_all_ended(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        while ranks_with_batch(0, trainer.strategy.root_device) > 0:
            serve_forward(pl_module)

    def _step_done(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loop = trainer.predict_loop if trainer.predicting else trainer._evaluation_loop
        if loop.batch_progress.is_last_batch:
            self._serve_until_all_ended(trainer, pl_module)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_coming(trainer)

    @override
    def on_test_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_coming(trainer)

    @override
    def on_predict_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_coming(trainer)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_done(trainer, pl_module)

    @override
    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_done(trainer, pl_module)

    @override
    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._step_done(trainer, pl_module)

    # ----- training: the same batches on every rank, or one sentence ------------------------------------------------

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._train_batches = 0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._train_batches += 1
        set_phase(f"training batch {idx} of epoch {trainer.current_epoch}")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        set_phase(f"the end of training batch {args[-1]} of epoch {trainer.current_epoch}")

    # Training is not served: a rank out of training data cannot make up the gradients its peers expect. At every
    # training epoch end the ranks compare how many batches each ran; a rank that ran fewer waits in that comparison
    # while its peers wait in the next batch's gathers, and the waits (see [Note: every wait knows where its peers are]
    # in ``hang_watch.py``) raise on every rank within seconds, naming the rank, its batch count and the batch the
    # others are in. Where all ranks finish the epoch, unequal counts (possible only with steps that run no collective)
    # raise here.
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch, ran = trainer.current_epoch, self._train_batches
        set_phase(f"the end of training epoch {epoch}, after {ran} batches")
        if not watched_collectives.available():
            return
        counts = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=trainer.strategy.root_device)
        counts[dist.get_rank()] = ran
        watched_collectives.reduce(counts, None, "sum", what=f"comparison of training batch counts (epoch {epoch})")
        if len(set(counts.tolist())) > 1:
            each = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(counts.tolist()))
            raise RuntimeError(
                f"The ranks ran different numbers of training batches in epoch {epoch} ({each}): their gradients were "
                "averaged over batches that do not correspond. Give every rank the same number of batches "
                "(Lightning's distributed sampler, drop_last=True, equal per-rank shards, or limit_train_batches)."
            )
