"""Weight averaging under ``myfsdp`` against ddp: the ranks of tests/test_weight_averaging.py's one spawned run.

Every Trainer here runs inside ranks that ``tests/distributed.py::run_distributed`` started (``LOCAL_RANK`` set, so
Lightning launches nothing and uses the process group as it is). Every run sees the same data and seed; rank 0 writes
what the test compares to OUT/results.pt:

- ``ddp``: Lightning's ``EMAWeightAveraging(decay=DECAY, update_every_n_steps=2)`` under ddp: the averaged weights and
  the validation losses computed with them (the reference nobody here wrote).
- ``sharded``: ``ShardedEMA(DECAY, update_every=2)`` under ``myfsdp``: the exported average, an EMA of the gathered
  weights computed in one process alongside, snapshots of the model before / during / after each validation, the
  bytes each rank's EMA holds and its shard's size. At step 3 it saves both checkpoint forms. ``shard_grad_op``:
  the same under SHARD_GRAD_OP (parameters kept gathered from forward to backward), validation included.
- ``resumed_sharded`` / ``resumed_full`` / ``resumed_consolidated``: fresh runs resumed from those step-3 checkpoints
  (the last: the sharded one consolidated by Lightning's own tool), to step 6; and
  ``misfit_*``: the same checkpoints resumed with an EMA of other parameters, which must be refused untouched.
- ``lora_ddp`` / ``lora``: a LoRA-adapted GPT (base frozen) holding a ``torch.optim.swa_utils.AveragedModel`` built in
  ``__init__``, under ddp and under ``myfsdp`` with ``ShardedEMA(trainable_only=True)`` beside it.
- ``refused``: Lightning's three averaging callbacks under ``myfsdp``: the message, and whether the model changed.

``run_one_rank`` is a run of its own on one rank, where nothing is sharded and Lightning's ``EMAWeightAveraging`` is
allowed: against ddp on one rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from lightning_fsdp import FSDPStrategy, ShardedEMA
from lightning_fsdp.demos.gpt import Block
from lightning_fsdp.demos.lora import add_lora
from lightning_fsdp.engine.state.state_dict import full_state_dict
from tests.scripts.strategy_common import LitGPT, make_trainer, token_loader

DECAY = 0.8
STEPS = 6  # two epochs of 3 steps: 12 samples, 2 per rank and step on 2 ranks
LR = 1e-2  # large enough that the average lies well away from the weights after a few steps


def weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The model's full weights on rank 0 (a collective under ``myfsdp``)."""
    module = trainer.lightning_module
    if isinstance(trainer.strategy, FSDPStrategy):
        return full_state_dict(module)
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class OneProcessEMA(L.Callback):
    """The same EMA computed from the gathered full weights on rank 0: what ``ShardedEMA`` must equal."""

    def __init__(self, update_every: int) -> None:
        self.update_every = update_every
        self.average: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if (trainer.global_step - 1) % self.update_every:
            return
        full = {name: p.float() for name, p in weights(trainer).items() if name in dict(pl_module.named_parameters())}
        if not self.average:
            self.average = {name: value.clone() for name, value in full.items()}
        for name, value in full.items():
            self.average[name].mul_(DECAY).add_(value, alpha=1 - DECAY)


class ValidationProbe(L.Callback):
    """Full weights before each validation epoch (listed before the EMA callback: before its swap), during its first
    batch, and after it ends; and the validation loss."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.records.append({"step": trainer.global_step, "before": weights(trainer)})

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if "during" not in self.records[-1]:
            self.records[-1]["during"] = weights(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.records[-1]["after"] = weights(trainer)
        self.records[-1]["val_loss"] = trainer.callback_metrics["val_loss"].item()


class SaveBothForms(L.Callback):
    """At ``step``, save the checkpoint in both forms (listed after the EMA callback, so after its update)."""

    def __init__(self, step: int, folder: Path) -> None:
        self.step, self.folder = step, folder

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        strategy = trainer.strategy
        for form in ("full", "sharded"):
            strategy.state_dict_type = form
            trainer.save_checkpoint(self.folder / f"{form}_step{self.step}.ckpt")
        strategy.state_dict_type = "sharded"


class ScaledGPT(LitGPT):
    """The tiny GPT with a frozen 0-dim parameter (a loss scale of 1), whose one row lives on the first rank only: the
    EMA must save it from there and give it back there. It stays constant because the engine's sharded checkpoints
    do not restore a 0-dim parameter that changed (the model's nor its optimizer state's; reported separately)."""

    def __init__(self) -> None:
        super().__init__(lr=LR)
        self.loss_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.loss_scale


class LoRAWithAverage(LitGPT):
    """The tiny GPT with LoRA on its attention and MLP inputs (everything else frozen) and, as a submodule built here
    before any sharding, torch's ``AveragedModel`` of it, updated after every optimizer step."""

    def __init__(self) -> None:
        super().__init__(lr=LR)
        add_lora(self.model, ["qkv", "fc"], rank=2, alpha=4.0)
        self.averaged = AveragedModel(self.model, avg_fn=get_ema_avg_fn(DECAY))
        self.averaged.requires_grad_(False)

    def on_train_batch_end(self, *args: Any) -> None:
        self.averaged.update_parameters(self.model)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, eps=1e-5)


def myfsdp() -> FSDPStrategy:
    return FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")


def fit(
    strategy: Any, callbacks: list[L.Callback], model: type[L.LightningModule] | None = None, **kwargs: Any
) -> L.Trainer:
    """Fit a model built from seed 0 (``ScaledGPT`` unless ``model`` names another class) for ``STEPS`` steps."""
    L.seed_everything(0)
    model = (model or ScaledGPT)()
    validation = kwargs.pop("validation", True)
    trainer = make_trainer(
        strategy, devices=dist.get_world_size(), max_steps=STEPS, callbacks=callbacks, limit_val_batches=1.0
    )
    val = token_loader(4, 2, seed=2) if validation else None
    trainer.fit(model, token_loader(12, 2), val, **kwargs)
    return trainer


def ema_memory(ema: ShardedEMA, module: torch.nn.Module, trainable_only: bool) -> dict[str, int]:
    """This rank's EMA bytes as its tensors' storages count them, against its shard's elements."""
    held = sum(row.average.untyped_storage().nbytes() for row in ema._ensure_rows())
    shard = sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
    model = sum(p.numel() for p in module.parameters())
    return {"held": held, "nbytes": ema.nbytes, "shard_numel": shard, "model_numel_local": model}


def all_ranks(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def sharded_runs(out: Path, results: dict[str, Any]) -> None:
    ema, probe = EMAWeightAveraging(decay=DECAY, update_every_n_steps=2, use_buffers=False), ValidationProbe()
    fit("ddp", [probe, ema])
    results["ddp"] = {
        "average": {name: p.detach().clone() for name, p in ema._average_model.module.named_parameters()},
        "val_loss": [record["val_loss"] for record in probe.records],
    }

    ema, probe, reference = ShardedEMA(decay=DECAY, update_every=2), ValidationProbe(), OneProcessEMA(2)
    trainer = fit(myfsdp(), [probe, ema, reference, SaveBothForms(3, out)])
    module = trainer.lightning_module
    results["sharded"] = {
        "export": ema.full_state_dict(),
        "reference": reference.average,
        "final": weights(trainer),
        "probe": probe.records,
        "memory": all_ranks(ema_memory(ema, module, trainable_only=False)),
        "full_numel": sum(p.numel() for p in ScaledGPT().parameters()),
        "updates": ema.updates,
        "state_key": ema.state_key,
    }
    ema, probe = ShardedEMA(decay=DECAY, update_every=2), ValidationProbe()
    fit(FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="SHARD_GRAD_OP"), [probe, ema])
    results["shard_grad_op"] = {"export": ema.full_state_dict(), "val_loss": [r["val_loss"] for r in probe.records]}
    for form in ("sharded", "full"):
        ema = ShardedEMA(decay=DECAY, update_every=2)
        trainer = fit(myfsdp(), [ema], ckpt_path=out / f"{form}_step3.ckpt", validation=False)
        results[f"resumed_{form}"] = {"export": ema.full_state_dict(), "updates": ema.updates}
        results[f"misfit_{form}"] = misfit_resume(out / f"{form}_step3.ckpt")
    consolidated = out / "consolidated_step3.ckpt"  # what Lightning's consolidate_checkpoint makes of the folder
    if dist.get_rank() == 0:
        torch.save(_format_checkpoint(_load_distributed_checkpoint(out / "sharded_step3.ckpt")), consolidated)
    dist.barrier()
    ema = ShardedEMA(decay=DECAY, update_every=2)
    fit(myfsdp(), [ema], ckpt_path=consolidated, validation=False)
    results["resumed_consolidated"] = {"export": ema.full_state_dict(), "updates": ema.updates}


def misfit_resume(checkpoint: Path) -> dict[str, Any]:
    """Resume ``checkpoint`` with an EMA of other parameters (same state key, ``trainable_only``): the refusal, and
    whether the model still holds the weights it was built with."""
    L.seed_everything(0)
    model = ScaledGPT()
    built = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = make_trainer(
        myfsdp(), devices=dist.get_world_size(), max_steps=STEPS, callbacks=[ShardedEMA(DECAY, 2, trainable_only=True)]
    )
    try:
        trainer.fit(model, token_loader(12, 2), ckpt_path=checkpoint)
        message = None
    except ValueError as error:
        message = str(error)
    after = full_state_dict(model)
    return {"message": message, "unchanged": all(torch.equal(after[k], v) for k, v in built.items()) if after else None}


def lora_runs(results: dict[str, Any]) -> None:
    trainer = fit("ddp_find_unused_parameters_true", [], model=LoRAWithAverage, validation=False)
    results["lora_ddp"] = {"weights": weights(trainer)}
    ema = ShardedEMA(decay=DECAY, trainable_only=True)
    trainer = fit(myfsdp(), [ema], model=LoRAWithAverage, validation=False)
    results["lora"] = {
        "weights": weights(trainer),
        "export": ema.full_state_dict(),
        "memory": all_ranks(ema_memory(ema, trainer.lightning_module, trainable_only=True)),
    }


def refused_runs(results: dict[str, Any]) -> None:
    results["refused"] = {}
    for callback in (WeightAveraging(), EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=1e-2)):
        model = LitGPT(lr=LR)
        before = {name: value.clone() for name, value in model.state_dict().items()}
        trainer = make_trainer(myfsdp(), devices=dist.get_world_size(), max_steps=STEPS, callbacks=[callback])
        try:
            trainer.fit(model, token_loader(12, 2))
            message = None
        except ValueError as error:
            message = str(error)
        after = model.state_dict()
        unchanged = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        results["refused"][type(callback).__name__] = {"message": message, "unchanged": unchanged}


def one_rank_runs(out: Path) -> dict[str, Any]:
    """Lightning's ``EMAWeightAveraging`` on one rank, where nothing is sharded, under ddp and under ``myfsdp``: the
    average, the validation losses (computed with it), the final weights and the saved checkpoints. The reference is
    ddp on one rank rather than the single-device default, which feeds the batches through no distributed sampler
    and so trains on other data."""
    results: dict[str, Any] = {}
    for label, strategy in (("ddp", "ddp"), ("myfsdp", FSDPStrategy(auto_wrap_policy={Block}))):
        ema, probe = EMAWeightAveraging(decay=DECAY, update_every_n_steps=2, use_buffers=False), ValidationProbe()
        trainer = fit(strategy, [probe, ema])
        trainer.save_checkpoint(out / f"ema_{label}.ckpt")
        results[label] = {
            "average": {name: p.detach().clone() for name, p in ema._average_model.module.named_parameters()},
            "val_loss": [record["val_loss"] for record in probe.records],
            "final": weights(trainer),
        }
    return results


def run_one_rank(rank: int, world_size: int, out: str) -> None:
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", NODE_RANK="0")
    torch.save(one_rank_runs(Path(out)), Path(out) / "one_rank.pt")


def run(rank: int, world_size: int, out: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size), NODE_RANK="0")
    results: dict[str, Any] = {}
    sharded_runs(Path(out), results)
    lora_runs(results)
    refused_runs(results)
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")
