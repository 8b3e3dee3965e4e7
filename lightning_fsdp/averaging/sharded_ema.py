"""``ShardedEMA``: an exponential moving average of the weights that costs each rank 1/W of the model.

Under ``strategy="myfsdp"`` every rank's registered parameters are its own dim-0 rows of the fp32 master weights
(``engine/runtime/param.py``). An EMA is element-wise, so each rank averages exactly those rows, in an fp32 tensor
shaped like its shard, right after the optimizer stepped them: no collective, and ``W`` ranks together hold one averaged
model. The average is gathered only when someone needs it whole:

- validation (``use_for_validation``): the averaged rows are copied into the shards, which the engine gathers as
  usual, and the shards' own values are copied back afterwards from a clone, bit for bit;
- checkpoints: the callback's state holds its rows as ``Shard(0)`` DTensors aliasing them, which the strategy saves
  in either form (``lightning_fsdp/checkpoint/callback_tensors.py``): gathered to full tensors on rank 0 in the
  full file, each rank's rows in the sharded folder; a resume, at any world size, gives every rank its rows back;
- :meth:`ShardedEMA.full_state_dict`: the averaged model as a full state dict on rank 0, for export.

Under a strategy whose parameters are whole (ddp, one device) the same callback is a plain EMA of the whole model.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_fsdp.checkpoint.callback_tensors import SHARDED_TENSORS, fold_callback_tensors
from lightning_fsdp.checkpoint.full import local_rows
from lightning_fsdp.engine.runtime.registry import fsdp_param_of
from lightning_fsdp.engine.state.state_dict import as_dtensor, full_state_dict


@dataclass
class _AveragedRows:
    """One parameter's running average: ``average`` (fp32) is shaped like ``param``, this rank's registered rows."""

    name: str
    param: nn.Parameter
    average: Tensor


class ShardedEMA(Callback):
    """Exponential moving average of the model's weights, each rank averaging its own shard.

    After every ``update_every``-th optimizer step (the step index counted from 0, as Lightning's
    ``EMAWeightAveraging(update_every_n_steps=...)`` counts it), ``average = decay * average + (1 - decay) * weights``;
    the first update copies the weights. The per-rank memory is one fp32 copy of the rank's shard (of the trainable
    parameters' shard with ``trainable_only``); :attr:`nbytes` reports it.

    Args:
        decay: the weight of the past, in [0, 1).
        update_every: update after every n-th optimizer step.
        use_for_validation: validate with the averaged weights (swapped in for each validation epoch, then back).
        trainable_only: average only the parameters that require gradients (a LoRA adapter's, say); the frozen ones
            never change, so their average is themselves, and :meth:`full_state_dict` takes them from the model.
    """

    def __init__(
        self, decay: float = 0.999, update_every: int = 1, use_for_validation: bool = True, trainable_only: bool = False
    ) -> None:
        if not (isinstance(decay, float | int) and 0.0 <= decay < 1.0):
            raise ValueError(f"ShardedEMA(decay={decay!r}) must be a number in [0, 1), such as 0.999.")
        if not (isinstance(update_every, int) and update_every >= 1):
            raise ValueError(f"ShardedEMA(update_every={update_every!r}) must be a positive int (1: every step).")
        self.decay = float(decay)
        self.update_every = update_every
        self.use_for_validation = use_for_validation
        self.trainable_only = trainable_only
        self._module: nn.Module | None = None
        self._rows: list[_AveragedRows] | None = None
        self._updates = 0  # 0: the rows hold nothing yet, and the first update copies the weights
        self._latest_update_step = 0  # the trainer's global_step at the last update
        self._backup: list[Tensor] | None = None  # the shards' own values while the average is swapped in

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay, update_every=self.update_every)

    @property
    def nbytes(self) -> int:
        """The bytes of averaged weights this rank holds (0 before the first update or load)."""
        return sum(row.average.numel() * row.average.element_size() for row in self._rows or [])

    @property
    def updates(self) -> int:
        """How many times the average was updated."""
        return self._updates

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The module is sharded in place later in setup; its parameters are read at the first use, by then shards.
        if self._module is not pl_module:
            self._module, self._rows = pl_module, None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1  # the index of the optimizer step just taken; none yet when negative
        if trainer.global_step > self._latest_update_step and step_idx % self.update_every == 0:
            self.update()
            self._latest_update_step = trainer.global_step

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights into the average (the callback calls this after optimizer steps)."""
        rows = self._ensure_rows()
        for row in rows:
            if self._updates == 0:
                row.average.copy_(row.param)
            else:
                row.average.mul_(self.decay).add_(row.param.detach(), alpha=1.0 - self.decay)
        self._updates += 1

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.use_for_validation and self._updates > 0:
            self._swap_in()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swap_out()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._swap_out()  # an interrupted validation must not leave the averaged weights in the model

    @contextmanager
    def averaged_weights(self) -> Generator[None, None, None]:
        """Run the block with the averaged weights in the model (its own weights restored exactly afterwards).

        For ``trainer.test(...)`` or ``trainer.predict(...)`` with the average after ``fit``, say. Nothing happens
        before the first update.
        """
        swapped = self._updates > 0 and self._backup is None
        if swapped:
            self._swap_in()
        try:
            yield
        finally:
            if swapped:
                self._swap_out()

    def full_state_dict(self) -> dict[str, Tensor]:
        """The averaged model as ``module.state_dict()`` with full tensors on the CPU, on rank 0 (``{}`` elsewhere).

        Parameters are the averages in the parameters' own dtype, buffers and parameters not averaged are the
        model's: ``load_state_dict`` of an unsharded copy of the model takes it as is. A collective under
        ``myfsdp``: call it on every rank.
        """
        module = self._require_module()
        with self.averaged_weights():
            if any(fsdp_param_of(param) is not None for param in module.parameters()):
                return full_state_dict(module)
            if dist.is_initialized() and dist.get_rank() != 0:
                return {}
            return {name: value.detach().to("cpu", copy=True) for name, value in module.state_dict().items()}

    @override
    def state_dict(self) -> dict[str, Any]:
        """Counters, and the averaged rows under ``sharded_tensors``: DTensors aliasing each rank's rows, which the
        strategy gathers for a full checkpoint or saves rank by rank in a sharded one (a collective for 0-dim
        parameters: the strategy calls it on every rank)."""
        state: dict[str, Any] = {"updates": self._updates, "latest_update_step": self._latest_update_step}
        if self._updates > 0:
            state[SHARDED_TENSORS] = self.sharded_tensors()
        return state

    def sharded_tensors(self) -> dict[str, Tensor]:
        """The averaged rows by parameter name, as a sharded checkpoint holds them (and a sharded load fills them in
        place): DTensors aliasing each rank's rows. Allocates them if nothing did yet."""
        return {row.name: _as_saved(row) for row in self._ensure_rows()}

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A file Lightning consolidated from a sharded folder keeps the averages beside ``callbacks``; put them where
        ``load_state_dict`` reads them (Lightning calls this first), under any strategy."""
        fold_callback_tensors(checkpoint)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the counters and this rank's rows of the saved averages (full tensors, or DTensors already loaded
        in place by a sharded checkpoint's load)."""
        saved = state_dict.get(SHARDED_TENSORS)
        if saved is not None:
            rows = self._ensure_rows()
            _check_names({row.name for row in rows}, saved)
            with torch.no_grad():
                for row in rows:
                    _load_row(row, saved[row.name])
        self._updates = int(state_dict["updates"]) if saved is not None else 0
        self._latest_update_step = int(state_dict["latest_update_step"])

    def _ensure_rows(self) -> list[_AveragedRows]:
        """The averaged rows, allocated (uninitialised) at the first need, when the model is sharded (again, before
        the first update, when an optimizer moved parameters to live whole since: see [Note: whole tensors])."""
        relaid = self._rows is not None and any(row.average.shape != row.param.shape for row in self._rows)
        if relaid and self._updates > 0:
            raise RuntimeError(
                "ShardedEMA's averages were laid out before an optimizer moved parameters to live whole on one rank; "
                "create the optimizers before the first update of the average (configure_optimizers does)."
            )
        if self._rows is None or relaid:
            module = self._require_module()
            self._rows = [
                _AveragedRows(name, param, torch.empty_like(param, dtype=torch.float32))
                for name, param in module.named_parameters()
                if param.requires_grad or not self.trainable_only
            ]
        return self._rows

    def _require_module(self) -> nn.Module:
        if self._module is None:
            raise RuntimeError("ShardedEMA has no model yet; pass it to Trainer(callbacks=[...]) and start fitting.")
        return self._module

    @torch.no_grad()
    def _swap_in(self) -> None:
        rows = self._ensure_rows()
        self._backup = [row.param.detach().clone() for row in rows]
        for row in rows:
            row.param.copy_(row.average)

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._backup is None:
            return
        for row, own in zip(self._ensure_rows(), self._backup, strict=True):
            row.param.copy_(own)
        self._backup = None


def _as_saved(row: _AveragedRows) -> Tensor:
    """The averaged rows in checkpoint form: a ``Shard(0)`` DTensor aliasing them, laid out as the parameter's own
    sharded-checkpoint DTensor; a whole tensor where the parameter is saved whole (not sharded, one rank, 0-dim)."""
    fsdp_param = fsdp_param_of(row.param)
    if fsdp_param is None or fsdp_param.layout.world_size == 1:
        return row.average.view(fsdp_param.shape) if fsdp_param is not None else row.average
    owner = fsdp_param.layout.owner
    if owner is not None:  # held whole by one rank (see [Note: whole tensors]): give every rank its average
        value = row.average.clone() if owner == fsdp_param.layout.rank else row.average.new_empty(fsdp_param.shape)
        dist.broadcast(value, src=dist.get_global_rank(fsdp_param.group, owner), group=fsdp_param.group)
        return value
    if len(fsdp_param.shape) == 0:  # the one row lives on the shard group's first rank: give every rank the value
        value = row.average.reshape(-1)[:1].clone() if row.average.numel() else row.average.new_zeros(1)
        dist.broadcast(value, src=dist.get_global_rank(fsdp_param.group, 0), group=fsdp_param.group)
        return value.view(())
    layout = as_dtensor(row.param)
    return DTensor.from_local(
        row.average, layout.device_mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride()
    )


def _load_row(row: _AveragedRows, saved: Tensor) -> None:
    if isinstance(saved, DTensor):  # a sharded load wrote these rows in place already; a copy onto itself is a no-op
        row.average.copy_(saved.to_local())
        return
    if fsdp_param_of(row.param) is None:
        if saved.shape != row.average.shape:
            raise ValueError(
                f"the checkpoint's ShardedEMA average of '{row.name}' has shape {tuple(saved.shape)} but the parameter "
                f"has shape {tuple(row.average.shape)}; resume a checkpoint of the same model."
            )
        row.average.copy_(saved)
        return
    local_rows(saved, row.param, row.average)  # this rank's rows of the full tensor, its shape checked


def _check_names(expected: set[str], saved: Mapping[str, Any]) -> None:
    missing, unexpected = sorted(expected - set(saved)), sorted(set(saved) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's ShardedEMA state does not fit this model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); resume with the model and the ShardedEMA(trainable_only=...) it was saved with."
        )
